"""Test-time compute on an ONNX graph: augmentation, training (bn, Tent), iterative inference,
and temperature scaling."""
