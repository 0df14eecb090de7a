"""Text in and out: tokenizing (on a few threads off the event loop), the `Tokenize` and `Detokenize`
answers, incremental detokenizing, stop strings, tool calls parsed from generated text (whole and
streamed), and prompt logprobs as text.
"""
