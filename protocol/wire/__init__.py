"""What travels: the wire messages and their validation, CurveZMQ transport with per-party rate limits,
the channels the roles talk through, capped rejection logs and the audit transcript."""
