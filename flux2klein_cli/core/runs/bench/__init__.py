"""What `flux2klein bench` measures: its options and dispatch (run.py), one module per phase."""
