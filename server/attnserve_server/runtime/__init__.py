"""How the server process runs on its machine: OpenMP's environment, malloc, open files, the garbage collector, the
event loop, idle spin, the quiet CPU layout and the OS's view of the threads. Each is set up at start-up,
before or around the request path's layers; none of them reads or writes a request's data (idle spin and
the layout are only told when a request was admitted quietly, or found company)."""
