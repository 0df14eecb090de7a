"""One scheduler per worker group, and the set of them: a `Replica` drives its worker (steps,
recovery, suspend and resume), `ReplicaSet` holds them with the `Router` that places a request,
`discovery` finds workers by DNS, and `followers` are the gateways' event streams.
"""
