"""ONNX Runtime sessions, the model bundle and its manifest, the batch path (local and on Ray
Data), and profiling."""
