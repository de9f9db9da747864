"""The graph conversions after export: the per-layer diagnosis of an int8 graph."""
