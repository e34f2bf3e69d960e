"""graddbg's distributed internals: what a watch (`graddbg.hooks` and its checks) and the
cross-rank checks (`graddbg.ddp_verify`) need to exchange with other ranks without ever
hanging a job. From the bottom up:

- `store`: the default process group's store, the one check-in (`RollCall`: a key per rank)
  and the one poll (short sleeps, so signals are handled), for both;
- `collective`: graddbg's own collectives, waited for by that poll and kept alive so that a
  process may end right after one; `all_gather`;
- `groups`: which ranks hold what, for both (the ranks of a group, the replicas of a
  DTensor's shard), and a watch's groups, found once (`discover`);
- `peers`: a watched rank's position and pulse in the store, and the bounded wait at a step
  boundary until every peer is at the same one;
- `arrival`: a watch's check-in and its meeting with the peers at each boundary, or why it
  goes on with local statistics;
- `stages`: the pipeline stages on this rank, their hooks, and the per-step summary
  between stages;
- `layout`: `Layout`, what a watch holds: a facade over `arrival`, `groups` and `stages`;
- `rendezvous` and `replicas`: a cross-rank check's header exchange bounded by its timeout,
  and its arguments, what each rank holds and its replica groups.

Every module here imports only `graddbg._errors`, `graddbg._model`, `graddbg._hookset` and
modules of this package: never `stats`, `checks`, `hooks` or `ddp_verify`, which sit on it
(tests/test_layout.py checks it).
"""
