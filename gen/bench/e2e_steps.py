"""One forward step of a Hugging Face causal LM over a static KV cache, fed from fixed buffers, as
serving engines run a decode step under a CUDA graph.

`CachedForward` holds the step's inputs in tensors that never move: the token ids [batch, q] and the
position `start` (a 0-dim tensor) of the first of them. Each call writes q positions of the cache
from `start` and leaves the greedy next tokens in `next_tokens`; a caller changes the buffers in
place between CUDA-graph replays (gen.timing.capture_graph). Everything that depends on the
position is computed from `start` on the GPU, inside the step:

- the attention mask is passed as a 4D additive mask [1, 1, q, cache length] (0 where a key
  position is at most the query's, the dtype's lowest value elsewhere), so that transformers uses it
  as given instead of building one, which some versions do with host-side checks (`mask.all()`)
  that a graph capture cannot hold;
- the cache's write position: versions that take `cache_position` get `start + arange(q)`; versions
  whose static cache layers count the tokens written in a device tensor (`cumulative_length`, added
  to by each write) get that counter set to `start` at the top of the step, so that replaying a step
  writes the same positions again instead of running past the cache.

Which keyword a version calls the cache (`cache` or `past_key_values`), whether it takes
`cache_position`, and how it limits the logits to the last position (`logits_to_keep`,
`num_logits_to_keep`) are read from the model's forward signature; the StaticCache's constructor
arguments from its own.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch


def static_cache(model, batch: int, length: int):
    """A transformers StaticCache for `batch` sequences of `length` positions, on the model's device."""
    from transformers import StaticCache

    accepted = inspect.signature(StaticCache.__init__).parameters
    kwargs = {"config": model.config, "max_cache_len": length}
    batch_name = next((name for name in ("max_batch_size", "batch_size") if name in accepted), None)
    if batch_name:   # older versions allocate the whole cache in the constructor
        kwargs[batch_name] = batch
    for name, value in (("device", model.device), ("dtype", model.dtype)):
        if name in accepted:
            kwargs[name] = value
    return StaticCache(**kwargs)


def _forward_keywords(model) -> dict:
    """The names this transformers version's forward uses: {"cache": ..., "cache_position": bool,
    "logits": name or None}."""
    accepted = inspect.signature(model.forward).parameters
    return {
        "cache": "cache" if "cache" in accepted else "past_key_values",
        "cache_position": "cache_position" in accepted,
        "logits": next((name for name in ("logits_to_keep", "num_logits_to_keep") if name in accepted), None),
    }


def pin_write_position(cache, start: torch.Tensor) -> None:
    """Make the cache's next write land at `start`, for caches that count their own writes."""
    for layer in getattr(cache, "layers", ()):
        counter = getattr(layer, "cumulative_length", None)
        if isinstance(counter, torch.Tensor):
            counter.copy_(start)


def causal_mask(positions: torch.Tensor, keys: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask [1, 1, q, len(keys)]: query i sees the key positions up to positions[i]. Built
    by kernels only (no host-to-device copy), so that a graph capture can hold it."""
    hidden = keys[None, :] > positions[:, None]
    mask = torch.zeros(hidden.shape, dtype=dtype, device=keys.device)
    return mask.masked_fill_(hidden, torch.finfo(dtype).min)[None, None]


class CachedForward:
    """model over `cache` for `batch` sequences of `q` new tokens, from fixed buffers.

    `tokens` [batch, q] and `start` (0-dim) are the inputs, `next_tokens` [batch] the output (the
    argmax of the last position's logits). `forward` is the model or its torch.compile'd form. With
    `keep_logits`, the last position's logits are also left in `logits` [batch, vocab] (fp32).
    """

    def __init__(self, model, cache, batch: int, q: int, length: int, forward=None, keep_logits: bool = False):
        device = model.device
        self.model, self.forward, self.cache = model, model if forward is None else forward, cache
        self.tokens = torch.zeros(batch, q, dtype=torch.long, device=device)
        self.start = torch.zeros((), dtype=torch.long, device=device)
        self.offsets = torch.arange(q, device=device)
        self.keys = torch.arange(length, device=device)
        self.next_tokens = torch.zeros(batch, dtype=torch.long, device=device)
        self.logits = torch.zeros(batch, model.config.vocab_size, device=device) if keep_logits else None
        self.keywords = _forward_keywords(model)

    def __call__(self) -> None:
        self._run(self.forward)

    def prime(self) -> None:
        """One step through the eager model: the StaticCache allocates its layers on their first
        update, and a compiled forward guards on that, so a compiled step primed this way compiles
        once, for the allocated cache (and a capture after one compiled call compiles nothing)."""
        self._run(self.model)

    def _run(self, forward) -> None:
        batch, q = self.tokens.shape
        positions = self.start + self.offsets
        pin_write_position(self.cache, self.start)
        # [batch, 1, q, length] as transformers' own masks are: the batch broadcast, not copied
        mask = causal_mask(positions, self.keys, self.model.dtype).expand(batch, 1, q, -1)
        kwargs = {self.keywords["cache"]: self.cache, "use_cache": True, "attention_mask": mask,
                  "position_ids": positions.expand(batch, -1)}
        if self.keywords["cache_position"]:
            kwargs["cache_position"] = positions
        if self.keywords["logits"]:
            kwargs[self.keywords["logits"]] = 1
        logits = forward(input_ids=self.tokens, **kwargs).logits
        self.next_tokens.copy_(logits[:, -1].argmax(-1))
        if self.logits is not None:
            self.logits.copy_(logits[:, -1])


def decode_step(model, batch: int, context: int, forward=None) -> CachedForward:
    """A decode step of `batch` sequences at the last position of a `context`-long cache: each step
    attends over the whole context, as the step after a `context - 1`-token history does."""
    step = CachedForward(model, static_cache(model, batch, context), batch, 1, context, forward)
    step.start.fill_(context - 1)
    return step


def prefill_step(model, tokens: int, forward=None) -> CachedForward:
    """A prefill of `tokens` positions of one sequence into an empty cache of that length."""
    return CachedForward(model, static_cache(model, 1, tokens), 1, tokens, tokens, forward)


@dataclass
class Greedy:
    """A greedy decode: the prefill's token, the `steps` decode steps' tokens, and each decode step's
    last-position logits [steps, vocab] (fp32)."""
    prefill_token: int
    tokens: list[int]
    logits: torch.Tensor


def greedy_decode(model, prompt: torch.Tensor, steps: int, replayed=None, follow: Greedy | None = None) -> Greedy:
    """`steps` greedy decode steps after `prompt` [1, P]: one prefill, then a decode step per token
    through a static cache of P + steps positions. With `follow` (another run's decode), each step is
    fed `follow`'s previous token instead of its own, so that both runs see the same history and
    their logits compare step by step. `replayed(step)` turns the decode step into what runs it (a
    captured CUDA graph's replay); by default it runs as it is."""
    length = prompt.shape[1] + steps
    cache = static_cache(model, 1, length)
    prefill = CachedForward(model, cache, 1, prompt.shape[1], length)
    prefill.tokens.copy_(prompt)
    prefill()
    prefill_token = int(prefill.next_tokens[0])
    history = [follow.prefill_token, *follow.tokens] if follow else None
    decode = CachedForward(model, cache, 1, 1, length, keep_logits=True)
    decode.tokens.fill_(history[0] if history else prefill_token)
    decode.start.fill_(prompt.shape[1])
    run = replayed(decode) if replayed else decode   # a capture's warm-up writes the first position, as step 0 does
    tokens, logits = [], []
    for step in range(steps):
        run()
        tokens.append(int(decode.next_tokens[0]))
        logits.append(decode.logits[0].clone())
        decode.tokens.fill_(history[step + 1] if history else tokens[-1])
        decode.start.add_(1)
    return Greedy(prefill_token, tokens, torch.stack(logits))
