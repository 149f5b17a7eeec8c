"""The engine core's side of the frontend: its sockets and the requests in flight (link.py),
an AddRequest checked and turned into a Request (intake.py, validation.py)."""
