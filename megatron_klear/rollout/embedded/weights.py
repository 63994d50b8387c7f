"""Weight loading of the embedded engine, by HF name: a complete update, a checked subset (all or
nothing), an HF checkpoint directory, memory release/resume (SGLang's memory saver) and checksums.


:class:`ModelWeights` is a part of :class:`~megatron_klear.rollout.embedded.engine.EmbeddedEngine`
with its own state: the weight version, and whether the weights are released or inconsistent (which
the decode loop checks, :meth:`ModelWeights.check_usable`). It shares the engine's model and lock.
"""

from __future__ import annotations

import torch


class WeightUpdateError(ValueError):
    """A weight update that does not fit the model; the message names the tensor."""


def tensor_checksum(t: torch.Tensor) -> str:
    """The sha256 of a tensor's bytes, 16 hex digits (what ``/weights_checker`` lists per parameter)."""
    import hashlib

    data = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(data).hexdigest()[:16]


class ModelWeights:
    """The weights of ``model``, loaded by HF name under ``lock`` (the engine's: no decode step runs
    while they change). ``version``: the weight version they are (None: the checkpoint's own)."""

    def __init__(self, model, lock):
        self.model, self._lock = model, lock
        self.version = None
        self._broken = None  # why the weights are inconsistent (a failed update), else None
        self._refilled = set()  # the parameters written since they became inconsistent
        self._released = None  # {parameter: shape} while the weights are released (release_weights)

    def check_usable(self) -> None:
        """Raises unless the weights can generate (not released, not left inconsistent)."""
        if self._released is not None:
            raise RuntimeError(
                "rollout.embedded: the weights are released (release_memory_occupation); resume them "
                "and load weights before generating"
            )
        if self._broken:
            raise RuntimeError(
                f"rollout.embedded: the weights are inconsistent {self._broken}; "
                "call update_weights again with every tensor before generating"
            )

    # ---------------------------------------------------------------- loading
    def update_weights(self, named_tensors, *, version: int | None = None) -> None:
        """Copy ``(HF name, tensor)`` pairs into the model, converting dtype and device.

        Every parameter must arrive exactly once; with tied embeddings ``lm_head.weight`` may be
        left out (if sent, it must equal ``model.embed_tokens.weight``). A list, tuple or dict is
        checked whole before the first copy, so a bad one leaves the weights untouched. A stream (a
        generator) is copied as it comes: an unknown name, a duplicate or a shape mismatch raises at
        once, missing names at the end, and a failure after some tensors were copied leaves the
        engine refusing to generate until a complete update.
        """
        if isinstance(named_tensors, dict):
            named_tensors = list(named_tensors.items())
        with self._lock, torch.no_grad():
            if isinstance(named_tensors, (list, tuple)):
                self._apply_weights(named_tensors, copy=False)  # all checks, nothing copied
            self._apply_weights(named_tensors, copy=True)
            self.version = version

    def load_named_weights(self, named_tensors, *, version=None, adopt: bool = False) -> list:
        """Copy some or all parameters, all or nothing: every ``(HF name, tensor)`` is checked (known
        name, given once, shape; a tied ``lm_head.weight`` must equal the embedding) before the first
        copy, so a failure leaves the weights and the version as they were. Parameters not given keep
        their values (SGLang's ``load_weights`` semantics; the HTTP server commits a weight-update
        session with it). ``adopt``: the tensors become the parameters' storage where their dtype,
        device and layout allow (no copy; the caller hands them over and must not touch them).
        Returns the storages replaced by adoption (no longer used by the model: reusable buffers)."""
        named_tensors = list(named_tensors.items()) if isinstance(named_tensors, dict) else list(named_tensors)
        replaced = []
        with self._lock, torch.no_grad():
            self._apply_weights(named_tensors, copy=False, require_all=False)
            if not adopt:
                self._apply_weights(named_tensors, copy=True, require_all=False)
            else:
                params = dict(self.model.named_parameters())  # a tied lm_head is the embedding: absent
                slices = self._weight_targets()
                for name, tensor in named_tensors:
                    param = params.get(name)
                    if param is None:
                        if name in slices:  # an expert's slice of a fused parameter: copied into
                            slices[name].copy_(tensor)
                        continue
                    tensor = tensor.to(device=param.device, dtype=param.dtype)
                    if tensor.is_contiguous() and tensor.shape == param.shape:
                        replaced.append(param.data)
                        param.data = tensor
                    else:
                        param.copy_(tensor)
                if not set(slices) - {n for n, _ in named_tensors}:  # every weight loaded
                    self._broken = None
            self.version = version
        return replaced

    def load_weights_from_dir(self, path: str, *, version=None) -> None:
        """Load every weight from an HF safetensors checkpoint directory through :meth:`update_weights`
        (same checks; the architecture must match). All or nothing: every tensor is read and checked
        before the first copy, so a failure leaves the current weights (and version) in place."""
        from megatron_klear.checkpoint.hf_io import HFReader

        reader = HFReader(path)
        try:
            tensors = [(key, reader.get(key)) for _, keys in reader.files() for key in sorted(keys)]
            try:
                self.update_weights(tensors, version=version)
            except WeightUpdateError as e:
                raise WeightUpdateError(f"{e} [checkpoint {path}]") from None
        finally:
            reader.close()

    def check_named_weights(self, named_tensors) -> None:
        """The checks of :meth:`load_named_weights` without copying (raises :class:`WeightUpdateError`)."""
        with torch.no_grad():
            self._apply_weights(list(named_tensors), copy=False, require_all=False)

    def checksums(self, skip=()) -> dict:
        """{parameter name: :func:`tensor_checksum`} (SGLang's ``/weights_checker``)."""
        out = {}
        with self._lock, torch.no_grad():
            for name, p in self.model.named_parameters():
                if any(s in name for s in skip):
                    continue
                out[name] = tensor_checksum(p)
        return out

    # ---------------------------------------------------------------- memory (colocated servers)
    def release_weights(self) -> int:
        """Free every parameter's storage (SGLang's ``release_memory_occupation`` of ``weights`` under
        ``--enable-memory-saver``); returns the bytes freed. Buffers (rotary frequencies) stay, as
        SGLang stashes and restores a model's static state. Generating or loading is refused until
        :meth:`resume_weights`."""
        with self._lock:
            if self._released is not None:
                return 0
            released, freed = {}, 0
            for p in self.model.parameters():  # a tied lm_head is the embedding: once
                released[p] = tuple(p.shape)
                freed += p.numel() * p.element_size()
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            self._released = released
            return freed

    def resume_weights(self) -> None:
        """Give the parameters their storage back. Their content is lost, as with SGLang's memory
        saver: floats are NaN (integers 0) and the engine refuses to generate until an update loads
        every weight (the colocated loop reloads them from disk next)."""
        with self._lock:
            released, self._released = self._released, None
            if released is None:
                return
            for p, shape in released.items():
                fill = float("nan") if p.dtype.is_floating_point else 0
                p.data = torch.full(shape, fill, dtype=p.dtype, device=p.device)
            self._broken = "since their memory was released and resumed (their content is lost)"
            self._refilled = set()

    @property
    def released(self) -> bool:
        return self._released is not None

    # ---------------------------------------------------------------- checks and copies
    def _weight_targets(self) -> dict:
        """{HF checkpoint name: the parameter, or the slice of one, that it loads into}. transformers
        keeps a MoE layer's experts fused (``mlp.experts.gate_up_proj`` [E, 2I, H] with gate rows
        then up rows, ``mlp.experts.down_proj`` [E, H, I]); checkpoints, SGLang and the trainer's
        weight sync name them one tensor per expert (``mlp.experts.{e}.{gate,up,down}_proj.weight``).
        Call under ``torch.no_grad()`` (the slices are views that are copied into)."""
        out = {}
        for name, p in self.model.named_parameters():
            prefix, _, kind = name.rpartition(".experts.")
            if prefix and kind in ("gate_up_proj", "down_proj") and p.dim() == 3:
                half = p.shape[1] // 2
                for e in range(p.shape[0]):
                    base = f"{prefix}.experts.{e}."
                    if kind == "gate_up_proj":
                        out[base + "gate_proj.weight"], out[base + "up_proj.weight"] = p[e, :half], p[e, half:]
                    else:
                        out[base + "down_proj.weight"] = p[e]
            else:
                out[name] = p
        return out

    def _apply_weights(self, named_tensors, *, copy: bool, require_all: bool = True) -> None:
        """Check (and with ``copy``, copy) ``(HF name, tensor)`` pairs: known names, each once, shapes,
        a tied ``lm_head.weight`` equal to the embedding, and with ``require_all`` every parameter. A
        failure after a copy marks the weights broken; a complete copy repairs them."""
        if self._released is not None:
            raise WeightUpdateError(
                "rollout.embedded: the weights are released (release_memory_occupation): "
                "resume them (resume_memory_occupation) before loading new ones"
            )
        params = self._weight_targets()
        tied = bool(getattr(self.model.config, "tie_word_embeddings", False)) and "lm_head.weight" not in params
        seen, tied_head, copied = set(), None, False
        try:
            for name, tensor in named_tensors:
                if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
                    raise TypeError(
                        f"rollout.embedded: update_weights expects (str, torch.Tensor) pairs, got "
                        f"({type(name).__name__}, {type(tensor).__name__})"
                    )
                if name in seen:
                    raise WeightUpdateError(f"rollout.embedded: update_weights: tensor '{name}' given twice")
                seen.add(name)
                if tied and name == "lm_head.weight":
                    tied_head = tensor
                    continue
                if name not in params:
                    raise WeightUpdateError(
                        f"rollout.embedded: update_weights: unknown tensor '{name}' (the model has "
                        f"{len(params)} parameters, e.g. '{next(iter(params))}')"
                    )
                if tuple(tensor.shape) != tuple(params[name].shape):
                    raise WeightUpdateError(
                        f"rollout.embedded: update_weights: tensor '{name}' has shape "
                        f"{tuple(tensor.shape)}, the model expects {tuple(params[name].shape)}"
                    )
                if copy:
                    params[name].copy_(tensor)
                    copied = True
            missing = sorted(set(params) - seen) if require_all else []
            if missing:
                raise WeightUpdateError(
                    f"rollout.embedded: update_weights: {len(missing)} parameter(s) not given: "
                    f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}"
                )
            if tied_head is not None:
                embed = self.model.get_input_embeddings().weight
                # after copying, the model's embedding is the new one; before, compare with the one given
                new_embed = (
                    embed if copy else next((t for n, t in named_tensors if n == "model.embed_tokens.weight"), embed)
                )
                if tuple(tied_head.shape) != tuple(embed.shape) or not torch.equal(
                    tied_head.to(embed), new_embed.to(embed)
                ):
                    raise WeightUpdateError(
                        "rollout.embedded: update_weights: 'lm_head.weight' differs from the embedding "
                        "of this tied-embedding model (tie_word_embeddings=true)"
                    )
        except BaseException as e:
            if copied:
                self._broken = f"after a failed update ({e})"
                self._refilled = set()
            raise
        if copy and self._broken:
            # a complete update repairs a broken state, in one call or bucket by bucket (every parameter
            # written since it broke: an in-memory push loads the weights a bucket at a time)
            self._refilled |= seen
            if not set(params) - self._refilled:
                self._broken, self._refilled = None, set()
