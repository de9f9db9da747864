"""The export stage and the graph conversions after it: tracing a network to ONNX (tracing.py),
the numeric check against PyTorch (checking.py), a classifier's extra graphs (extras.py), the
compressed variants (compressed.py), writing the bundle (writing.py), export_bundle and the
classifiers' exporter (bundle.py); the graphs derived from one trace (graphs.py) and the
per-layer diagnosis of an int8 graph (diagnosis.py)."""
