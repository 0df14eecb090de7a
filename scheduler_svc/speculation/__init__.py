"""Speculative decoding on the scheduler's side: n-gram proposals from a sequence's own tokens
(`ngram_proposer`), each sequence's drafting state and back-off (`draft_state`), and the `Speculator`
that decides how many drafts a decode carries and settles what the worker kept.
"""
