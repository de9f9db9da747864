"""ttc-pipeline's internals, one sub-package per role (docs/design.md draws the map). The
command-line tools a user runs, and the card's config.py and utils.py, stay at the repository
root."""
