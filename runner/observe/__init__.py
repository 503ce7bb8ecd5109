"""What people watch: status, report, alerts, progress, metrics, doctor and the job log. It reads what
the batch and storage write and never drives the batch."""
