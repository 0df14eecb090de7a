"""Where a generation runs: the `Backend` interface, the scheduler backend (`Submit` and the one
`Follow` stream of events), the command bridge (an external program given the prompt in
`HETERO_PROMPT`), and the fallback from the one to the other after retries.
"""
