"""What `colo-data bench` runs and prints: a pipeline timed through `cd.Loader` with a simulated
training step (`runs.py`), the same pipeline through Grain's own `DataLoader`, the baseline that
benchmarks/ measures against too (`grain_baseline.py`), and the report, its JSON and plot
(`report.py`)."""
