"""Online prediction: a bundle opened once and asked row by row. predictor.py opens a bundle the
one way every caller does (inference.py, its Ray workers, serve.py, users' code: the public
`Predictor`); batcher.py joins concurrent requests into model runs; app.py is serve.py's
FastAPI application (its endpoints, limits, metrics and reloads); ray_serve.py deploys that
application on Ray Serve; tool.py hands a bundle to DSPy as a tool.

May import utils and every layer below it: inputs, serving, testtime, tasks, options (its
stages take ttc/options/stages.py's InferenceOptions and ServeOptions, never the whole Config),
reporting; nothing imports it but the CLIs.
"""
