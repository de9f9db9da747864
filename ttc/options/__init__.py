"""The tool's settings, one dataclass per stage (data, training, the LM teacher, export,
quantization, each test-time method, the ONNX Runtime session, batch inference, output): each
owns its flags (default, help, group, the scripts that take it), the checks of its own values
and the helpers that read them. config.py composes them into the `Config` the CLIs parse. The modules import only utils,
ttc/inputs, ttc/tasks, ttc/serving/runtime.py and ttc/reporting/sections.py (the plot names):
never torch, DSPy or onnxruntime at import, since every CLI builds its --help from them."""
