"""Semantic segmentation (`--model_type image_segmenter`): its data, networks and metrics."""
