"""Model types as entries: one module per type (image.py, text.py, tabular.py) holding its Task —
the --model_type name, the manifest's preprocessing kind, its --arch names, its builtin: data sets
and the flags the stages branch on — and registry.py, the table of them. The entries are plain
data and import nothing else of the package, so every folder may read them without a cycle; the
modules that do the work keep their per-kind function in their own table keyed by the kind."""
