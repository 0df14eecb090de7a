"""Prompts on the HTTP API: completions' `echo` and vLLM's `prompt_logprobs` extension.

- `echo` (completions): the choice's text is prompt + completion. With `logprobs`, the legacy
  logprobs object (tokens, token_logprobs, top_logprobs, text_offset) starts with one entry per
  prompt token, the first with `null` token_logprob and top_logprobs (it has no context), then
  the generated tokens: the shape lm-evaluation-harness reads for likelihoods. `max_tokens: 0`
  with echo returns the prompt alone.
- `prompt_logprobs: N` (completions and chat, vLLM's extension): the choice gets vLLM's
  `prompt_logprobs` list, `[null, {"<token id>": {"logprob", "rank", "decoded_token"}, ...}, ...]`:
  at each position the prompt token and the N most likely tokens.
- Streaming: the prompt (and its logprobs) come in each choice's first chunk, as vLLM sends them.

The engine computes prompt logprobs once per request (gRPC `params.prompt_logprobs`, on sample 0's
first message); with n > 1 every choice of that prompt shows them. The prompt's token ids are
the ones the gateway tokenizes the request into (`validation.prompt_token_ids`, deterministic).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hetero_common.tokenizer import TextTokenizer
from gateway.validation import prompt_token_ids
from hetero.v1 import inference_pb2


def engine_prompt_logprobs(echo: bool, logprobs: int | None, prompt_logprobs: int | None,
                           max_tokens: int | None) -> int | None:
    """`params.prompt_logprobs` for a completions body (None: not asked). Echo with logprobs needs
    the prompt's; echo with max_tokens 0 asks for them too, because the engine serves max_tokens 0
    only as prompt scoring."""
    wanted = [n for n in (prompt_logprobs, logprobs if echo else None) if n is not None]
    if echo and max_tokens == 0 and not wanted:
        wanted = [0]
    return max(wanted) if wanted else None


@dataclass
class _Prompt:
    text: str
    token_ids: list[int]
    scored: inference_pb2.GenerateResponse | None = None  # the message carrying its prompt logprobs


@dataclass
class PromptShaping:
    """Per request of an HTTP call: its prompt, and what each of its choices shows of it."""

    tokenizer: TextTokenizer
    n: int  # choices per request
    echo: bool = False
    echo_logprobs: int | None = None  # completions' `logprobs` when echo is set
    vllm_prompt_logprobs: int | None = None
    prompts: list[_Prompt] = field(default_factory=list)

    @classmethod
    def build(cls, tokenizer: TextTokenizer, requests: list[inference_pb2.GenerateRequest], n: int, echo: bool,
              logprobs: int | None, prompt_logprobs: int | None,
              max_model_len: int | None = None) -> "PromptShaping | None":
        """None when the call asks for nothing of its prompt. A prompt that cannot fit `max_model_len`
        is refused before it is tokenized."""
        if not echo and prompt_logprobs is None:
            return None
        shaping = cls(tokenizer, n, echo, logprobs if echo else None, prompt_logprobs)
        for request in requests:
            ids = prompt_token_ids(request, tokenizer, max_model_len)
            kind = request.WhichOneof("input")
            text = request.prompt if kind == "prompt" else tokenizer.decode(ids, skip_special_tokens=False)
            shaping.prompts.append(_Prompt(text, ids))
        return shaping

    def observe(self, index: int, part: inference_pb2.GenerateResponse) -> None:
        """Keep the message carrying the prompt's logprobs (sample 0's first) for all its choices."""
        prompt = self.prompts[index // self.n]
        if part.prompt_logprobs and prompt.scored is None:
            prompt.scored = part

    def text_offset(self, index: int) -> int:
        """Where the generated text starts in the choice's text."""
        return len(self.prompts[index // self.n].text) if self.echo else 0

    def completion_choice(self, choice: dict[str, Any], index: int) -> None:
        """Prepend the prompt to a completions choice (or its first chunk); add vLLM's prompt_logprobs."""
        prompt = self.prompts[index // self.n]
        if self.echo:
            choice["text"] = prompt.text + choice["text"]
            if self.echo_logprobs is not None:
                choice["logprobs"] = _concat(self._legacy(prompt), choice.get("logprobs"))
        if self.vllm_prompt_logprobs is not None:
            choice["prompt_logprobs"] = self._vllm(prompt)

    def chat_choice(self, choice: dict[str, Any], index: int) -> None:
        if self.vllm_prompt_logprobs is not None:
            choice["prompt_logprobs"] = self._vllm(self.prompts[index // self.n])

    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _scored(self, prompt: _Prompt) -> list[tuple[inference_pb2.TokenLogprob | None, list[inference_pb2.TokenLogprob]]]:
        """Per prompt token: its scored entry and alternatives (None for the first, which has no context)."""
        out: list[tuple[inference_pb2.TokenLogprob | None, list[inference_pb2.TokenLogprob]]] = [(None, [])]
        scored = prompt.scored
        for i in range(1, len(prompt.token_ids)):
            if scored is None or i - 1 >= len(scored.prompt_logprobs):
                out.append((None, []))
                continue
            alts = scored.prompt_top_logprobs[i - 1].candidates if i - 1 < len(scored.prompt_top_logprobs) else []
            out.append((scored.prompt_logprobs[i - 1], list(alts)))
        return out

    def _legacy(self, prompt: _Prompt) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        offset = 0
        for position, (entry, alts) in enumerate(self._scored(prompt)):
            token = entry.token if entry is not None else self._token(prompt.token_ids[position])
            out["tokens"].append(token)
            out["token_logprobs"].append(entry.logprob if entry is not None else None)
            top: dict[str, float] | None = None
            if entry is not None:
                top = {}
                for c in alts[:self.echo_logprobs]:  # best first; two ids can decode alike: keep the likelier
                    top.setdefault(c.token, c.logprob)
            out["top_logprobs"].append(top)
            out["text_offset"].append(offset)
            offset += len(token)
        return out

    def _vllm(self, prompt: _Prompt) -> list[dict[str, dict[str, Any]] | None]:
        k = self.vllm_prompt_logprobs or 0
        out: list[dict[str, dict[str, Any]] | None] = []
        for entry, alts in self._scored(prompt):
            if entry is None:
                out.append(None)
                continue
            alts = alts[:k]
            ranks = {c.token_id: rank for rank, c in enumerate(alts, start=1)}
            # The prompt token's rank is known when it is among the alternatives; the engine does
            # not count the tokens above it otherwise (null).
            position = {str(entry.token_id): {"logprob": entry.logprob, "rank": ranks.get(entry.token_id),
                                              "decoded_token": entry.token}}
            for c in alts:
                position.setdefault(str(c.token_id), {"logprob": c.logprob, "rank": ranks[c.token_id],
                                                      "decoded_token": c.token})
            out.append(position)
        return out


def _concat(prompt: dict[str, list[Any]], generated: dict[str, list[Any]] | None) -> dict[str, list[Any]]:
    if not generated:
        return prompt
    return {key: prompt[key] + generated[key] for key in prompt}
