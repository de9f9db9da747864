"""The training stage (train.py, pipeline.py): the model type's trainer run (here or on Ray
Train), compressed and calibrated as asked, its health judged, and its manifest and weights
written (stage.py, health.py). The networks and loops it trains with live in ttc/nets."""
