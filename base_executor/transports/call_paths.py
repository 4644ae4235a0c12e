"""How the data loop took each call: the keys of LocalServer.paths and of StatsReply.call_paths
(`base-executor stats`, the Prometheus endpoint's symbiont_call_paths).

Same-GPU calls: served by the tenant's native lane (LATE counts those of them whose input was in
already when the lane queued them: the tenant's GPU had waited for our host), run at once on the
tenant's own stream (OWN; HELD_OWN after waiting on the host behind a queued call of the tenant),
held until their input was in and then queued for the scheduler (HELD_QUEUED), queued with their
input in (QUEUED), or queued before it (AHEAD,
`serve --gpu-batches`), or run as a step program's run from Python (PROGRAM; the lane's runs count
as NATIVE; GANG: in a gang's round with other tenants' runs, transports/gangs.py). Other tenants'
calls: from a host mailbox (MAILBOX: CPU tenants), or from a remote transport (REMOTE: gRPC).
"""
NATIVE = "native lane"
LATE = "native lane, input in first"
OWN = "own stream"
HELD_OWN = "own stream after held"
HELD_QUEUED = "held, then queued"
QUEUED = "queued, input in"
AHEAD = "queued ahead"
MAILBOX = "host mailbox"
REMOTE = "remote"
PROGRAM = "step program"
GANG = "step program, ganged"
