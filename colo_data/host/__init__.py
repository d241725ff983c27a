"""One host's share of the pipeline: order, read, transform, batch; worker processes; CPU and memory budgets."""
