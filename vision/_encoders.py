"""Text encoders behind one small protocol, each with a fingerprint known before its weights load."""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
import xxhash
from tqdm import tqdm

from promptstore.errors import InvalidInputError, ModelUnavailableError

__all__ = ["TextEncoder", "OpenCLIPTextEncoder", "UltralyticsTextEncoder", "file_digest"]

_digests: dict[tuple[str, int, int], str] = {}


def file_digest(path: str | os.PathLike[str]) -> str:
    """xxh3-128 of a file, memoised by (path, size, mtime): a weights file is read once per process."""
    p = Path(path).resolve()
    st = p.stat()
    memo = (str(p), st.st_size, st.st_mtime_ns)
    if memo not in _digests:
        h = xxhash.xxh3_128()
        with open(p, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
        _digests[memo] = h.hexdigest()
    return _digests[memo]


@runtime_checkable
class TextEncoder(Protocol):
    """What set_classes needs from a text encoder."""

    @property
    def fingerprint(self) -> str:
        """Names exactly what the encoder computes; known without loading the weights."""
        ...

    @property
    def dim(self) -> int:
        """Length of each text feature vector."""
        ...

    @property
    def loaded(self) -> bool:
        """Whether the model has been built (a full cache hit never builds it)."""
        ...

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """L2-normalised float32 features, shape (len(texts), dim)."""
        ...


def _check_texts(texts: Sequence[str]) -> list[str]:
    if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
        raise InvalidInputError("texts must be a list of strings")
    return list(texts)


class _BatchedEncoder:
    """Encodes only what it is given, sorted by token length, in batches, with a progress bar."""

    batch: int
    trim: bool
    _dim: int
    _model: Any

    @property
    def dim(self) -> int:
        """Length of each text feature vector."""
        return self._dim

    @property
    def loaded(self) -> bool:
        """Whether the model has been built."""
        return self._model is not None

    def _tokenize(self, texts: list[str]) -> Any: ...

    def _forward(self, tokens: Any) -> Any: ...

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        import torch

        texts = _check_texts(texts)
        if not texts:
            return np.zeros((0, self.dim), np.float32)
        tokens = self._tokenize(texts)
        lengths = (tokens != 0).sum(1)
        order = torch.argsort(lengths, stable=True)
        out = np.empty((len(texts), self.dim), np.float32)
        bar = tqdm(total=len(texts), desc="promptstore: encoding class names", unit="name",
                   disable=None if len(texts) > 2 * self.batch else True, leave=False)
        with torch.inference_mode():
            for start in range(0, len(texts), self.batch):
                idx = order[start : start + self.batch]
                batch = tokens[idx]
                if self.trim:
                    # The causal mask keeps every position from seeing what follows it, and the
                    # feature is read at the end-of-text token: padding past the longest text in
                    # the batch changes nothing (tests/test_vision.py checks it against 77 tokens).
                    batch = batch[:, : int(lengths[idx].max())]
                feats = self._forward(batch).float()
                out[idx.numpy()] = torch.nn.functional.normalize(feats, dim=-1).cpu().numpy()
                bar.update(len(idx))
        bar.close()
        return out


class OpenCLIPTextEncoder(_BatchedEncoder):
    """An open_clip text tower, e.g. ``MobileCLIP2-B``.

    Args:
        model_name: an open_clip architecture name.
        pretrained: None for a deterministic random init from ``seed``; an open_clip tag; or a
            checkpoint path (fingerprinted by its digest).
        seed: the random-init seed.
        device: where to run.
        batch: texts per forward pass.
        trim: trim each batch's context to its longest text (exact; see above). False runs
            the full 77-token context, as ultralytics does.
    """

    def __init__(self, model_name: str = "MobileCLIP2-B", pretrained: str | os.PathLike[str] | None = None,
                 seed: int = 0, device: str = "cpu", batch: int = 64, trim: bool = True) -> None:
        import open_clip

        if model_name not in open_clip.list_models():
            raise InvalidInputError(f"unknown open_clip model {model_name!r}")
        self.model_name, self.pretrained, self.seed = model_name, pretrained, seed
        self.device, self.batch, self.trim = device, batch, trim
        self._model: Any = None
        self._dim = int(open_clip.get_model_config(model_name)["embed_dim"])
        if pretrained is None:
            import torch

            # A random init is fixed by the architecture, the seed and the code that draws it.
            self._fp = (f"open_clip:{model_name}:random:seed={seed}:open_clip={open_clip.__version__}"
                        f":torch={torch.__version__.split('+')[0]}")
        elif Path(pretrained).is_file():
            self._fp = f"open_clip:{model_name}:file:{file_digest(pretrained)}"
        else:
            self._fp = f"open_clip:{model_name}:tag:{pretrained}"

    @property
    def fingerprint(self) -> str:
        return self._fp

    def _build(self) -> Any:
        if self._model is None:
            import open_clip
            import torch

            if self.pretrained is None:
                torch.manual_seed(self.seed)
            try:
                model = open_clip.create_model(self.model_name, pretrained=None if self.pretrained is None
                                               else str(self.pretrained), device=self.device)
            except RuntimeError as exc:
                raise ModelUnavailableError(f"cannot load open_clip weights {self.pretrained!r}: {exc}") from exc
            self._model = model.eval()
            self._tokenizer = open_clip.get_tokenizer(self.model_name)
        return self._model

    def _tokenize(self, texts: list[str]) -> Any:
        self._build()
        return self._tokenizer(texts)

    def _forward(self, tokens: Any) -> Any:
        import torch

        model = self._build()
        text = getattr(model, "text", model)  # CustomTextCLIP keeps its tower in .text
        tokens = tokens.to(self.device)
        n = tokens.shape[1]
        # open_clip's own forward, with the causal mask and positions cut to this batch's length.
        x = text.token_embedding(tokens) + text.positional_embedding[:n]
        mask = text.attn_mask[:n, :n] if text.attn_mask is not None else None
        x = text.ln_final(text.transformer(x, attn_mask=mask))
        x = x[torch.arange(x.shape[0], device=x.device), tokens.argmax(dim=-1)]  # the end-of-text token
        proj = text.text_projection
        return proj(x) if isinstance(proj, torch.nn.Module) else x @ proj


# ultralytics' TorchScript text encoders: variant -> (file name, feature size)
_ULTRALYTICS = {"mobileclip:blt": ("mobileclip_blt.ts", 512), "mobileclip2:b": ("mobileclip2_b.ts", 512)}


class UltralyticsTextEncoder(_BatchedEncoder):
    """ultralytics' TorchScript MobileCLIP text encoders, from a local file, without the network
    or the ``clip`` package (open_clip's bundled BPE is the same vocabulary).

    Args:
        variant: ``"mobileclip:blt"`` (YOLOE-11/v8) or ``"mobileclip2:b"`` (YOLOE-26).
        weights: the ``.ts`` file; default: ultralytics' weights folder, then the working folder.
        device: where to run.
        batch: texts per forward pass.

    The fingerprint is the file's digest; while the file is absent it names the published
    asset (so NPZ-imported embeddings can be found without it).
    """

    trim = False  # a traced module: run the 77-token context it was traced with

    def __init__(self, variant: str = "mobileclip:blt", weights: str | os.PathLike[str] | None = None,
                 device: str = "cpu", batch: int = 80) -> None:
        if variant not in _ULTRALYTICS:
            raise InvalidInputError(f"unknown ultralytics text model {variant!r}; known: {', '.join(_ULTRALYTICS)}")
        self.variant, self.device, self.batch = variant, device, batch
        self.file_name, self._dim = _ULTRALYTICS[variant]
        self.weights = Path(weights) if weights is not None else self._find()
        self._model: Any = None

    def _find(self) -> Path | None:
        candidates = [Path(self.file_name)]
        try:
            from ultralytics.utils import WEIGHTS_DIR

            candidates.insert(0, Path(WEIGHTS_DIR) / self.file_name)
        except ImportError:
            pass
        return next((c for c in candidates if c.is_file()), None)

    @property
    def fingerprint(self) -> str:
        if self.weights is not None and self.weights.is_file():
            return f"ultralytics:{self.variant}:file:{file_digest(self.weights)}"
        return f"ultralytics:{self.variant}:published:{self.file_name}"

    def _build(self) -> Any:
        if self._model is None:
            import torch

            if self.weights is None or not self.weights.is_file():
                raise ModelUnavailableError(
                    f"the {self.variant} text encoder needs {self.file_name}; put it in ultralytics' weights folder "
                    f"or the working folder, or pass UltralyticsTextEncoder(weights=PATH). It is published at "
                    f"https://github.com/ultralytics/assets/releases/download/v8.3.0/{self.file_name}"
                )
            with warnings.catch_warnings():  # torch 2.14 marks jit.load deprecated; ultralytics still ships .ts
                warnings.simplefilter("ignore", FutureWarning)
                self._model = torch.jit.load(str(self.weights), map_location=self.device).eval()
        return self._model

    def _tokenize(self, texts: list[str]) -> Any:
        import open_clip

        return open_clip.tokenize(texts)  # truncates to 77 tokens like clip.tokenize(truncate=True)

    def _forward(self, tokens: Any) -> Any:
        return self._build()(tokens.to(self.device))
