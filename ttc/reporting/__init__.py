"""What a run reports: the evaluation section, metrics, plots and the HTML page."""
