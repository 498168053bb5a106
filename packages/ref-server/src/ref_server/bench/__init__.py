"""`ref-server bench`: a load generator for a running deployment (or any OpenAI-compatible
server), and the figures it reports.

- `workload`: the requests (length distributions, a length file, a shared prefix, a seed);
- `targets`: sending one request through the router's gRPC API or the OpenAI HTTP API;
- `runner`: the schedules (Poisson rate, fixed concurrency, fill) and a sweep of them;
- `report`: each run's figures (throughput, TTFT, TPOT, cache hits, errors, the fill window);
- `table`, `plot`: the document as a table and as a latency-throughput PNG.
"""
