"""A training run: its configuration and its model as every party holds it (``config``, ``run_model``),
who takes part (``participants``, the run skeleton both servers share, over ``server_connections``),
the server with its round steps, blame, checkpoint and report, and the hospital with its metrics."""
