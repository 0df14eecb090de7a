"""Speculative decoding on the scheduler's side: n-gram proposals from a sequence's own tokens
(`ngram_proposer`), each sequence's drafting state and back-off (`draft_state`, kept by seq id in the
`Speculator`), what drafts cost the worker's steps (`step_cost`), and the `Speculator` that decides how
many drafts a decode carries and settles what the worker kept.
"""
