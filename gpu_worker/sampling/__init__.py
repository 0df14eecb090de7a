"""From a step's logits to its tokens: the sampler, the logits processors (penalties, bias, bad
words, min tokens), constrained decoding's grammar masks, speculative drafts' rows and their
verification, and prompt logprobs. A new sampling control goes here.
"""
