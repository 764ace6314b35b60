"""How the server process runs on its machine: OpenMP's environment, malloc, the garbage collector, the
event loop, and idle spin. Each is set up at start-up, before or around the request path's layers; none
of them reads or writes a request's data (idle spin is only told when a request was admitted quietly)."""
