"""What several test modules share, in one place: plain functions and constants, no fixtures.

Fixtures live in tests/conftest.py; a test module never imports from another test module.
"""
