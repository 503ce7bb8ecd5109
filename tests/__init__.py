"""kvbatch's tests: a package, so every test module imports its helpers as `tests.helpers.<module>`."""
