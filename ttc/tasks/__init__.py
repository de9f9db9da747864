"""Model types as entries: one per type (image.py, text.py, tabular.py) holding its Task — the
--model_type name, the manifest's preprocessing kind, its --arch names, its builtin: data sets, the
flags the stages branch on, and its Parts: where its data reader, row encoder, networks and
evaluation live, as "module:name" references the stages resolve when they need them — and
registry.py, the table of them. The entries are plain data and import nothing else of the
package, so every folder may read them without a cycle. A new type may keep its own code in a
folder here (ttc/tasks/TYPE/, its entry in __init__.py); that code may use the other layers."""
