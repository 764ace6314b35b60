"""attnserve's load generator and measurements: `attnserve bench`, Triton's perf_analyzer driven
against the KServe edge, the in-process limit, plots. It uses the server and the client; neither
imports it (the `attnserve` command loads it only for `bench`)."""
