"""graddbg's distributed internals: what a watch and the cross-rank checks of
`graddbg.ddp_verify` need to exchange with other ranks without ever hanging a job.

- `collective`: graddbg's own collectives, waited for with short sleeps (signals are
  handled) and kept alive until a process may end right after one;
- `peers`: a watched rank's position and pulse in the store, and the bounded wait at a step
  boundary until every peer is at the same one;
- `layout`: which ranks a watch exchanges what with (the check-in, the groups, the
  pipeline stages, the per-step summary);
- `rendezvous`: a cross-rank check's header exchange, bounded by its timeout;
- `replicas`: a cross-rank check's arguments, what each rank holds and its replica groups.

Every module here imports only `graddbg._errors`, `graddbg._model` and modules of this
package: never `stats`, `checks`, `hooks` or `ddp_verify`, which sit on it.
"""
