"""What a batch is: config, manifest, task states, result schema and policies. No Ray, no torch."""
