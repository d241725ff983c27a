"""Reading records: sources (Parquet, Arrow IPC), column conversions, gather, the row-group cache."""
