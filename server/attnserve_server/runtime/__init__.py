"""How the server process runs on its machine: OpenMP's environment, malloc, the garbage collector, the
event loop, and idle spin. Each is set once, at start-up or around the layers; none of them touches a
request's data."""
