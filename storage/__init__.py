"""Where bytes live: the Parquet checkpoint log, the job folder, per-task scratch dirs, KV blocks. No Ray."""
