"""Text encoders behind one small protocol, each with a fingerprint known before its weights load."""

from __future__ import annotations

import os
import warnings
from abc import abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
from tqdm import tqdm

from promptstore import file_digest
from promptstore.errors import InvalidInputError, ModelUnavailableError, UnsupportedModelError

__all__ = ["TextEncoder", "OpenCLIPTextEncoder", "UltralyticsTextEncoder"]



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
    """Encodes only what it is given, sorted by token length, in batches, with a progress bar.

    The fingerprint is known before the weights load (a full hit never builds the tower). Once
    built, the tower is a live module anyone can reach: while its live identity (weights,
    settings, hooks, code; :mod:`promptstore._live`) is what it was when built, the fingerprint
    stays the file's; after any change it names the live identity too. Autocast and other
    ambient torch state are always part of it.
    """

    batch: int
    trim: bool
    _dim: int
    _model: Any
    _built: Any = None  # the tower's live identity right after it was built

    _loaded: str | None = None  # the digest of the weights file's bytes the built tower was loaded from

    @property
    def fingerprint(self) -> str:
        from promptstore._live import ambient_identity

        self._follow_file()
        fp = f"{self._source_fingerprint()}:{ambient_identity()}"
        if self._model is None:
            return fp
        live = self._live_identity()
        return fp if live == self._built else f"{fp}:live:{live}"

    @abstractmethod  # every subclass names its source (not an ABC: marks it for the type checker only)
    def _source_fingerprint(self) -> str: ...

    def _weights_file(self) -> Path | None:
        """The file the tower is built from (None: no file, e.g. random weights)."""
        return None

    def _file_digest(self) -> str:
        """The weights file's digest: of the bytes loaded once built, of the file on disk before."""
        if self._model is not None and self._loaded is not None:
            return self._loaded
        path = self._weights_file()
        return file_digest(path) if path is not None else ""

    def _follow_file(self) -> None:
        """A weights file replaced since the build: the tower is dropped and built again from it."""
        path = self._weights_file()
        if self._model is None or self._loaded is None or path is None:
            return
        try:
            now = file_digest(path)
        except OSError:
            return  # gone: the built tower still serves under the bytes it was loaded from
        if now != self._loaded:
            self._model, self._built, self._loaded = None, None, None

    def _load_file(self, load: Any) -> Any:
        """``load()`` the weights file, keyed by the bytes it read (the file hashed before and after).

        Raises:
            ModelUnavailableError: the file changed while it was being loaded.
        """
        path = self._weights_file()
        before = file_digest(path) if path is not None else None
        model = load()
        if path is not None and file_digest(path) != before:
            raise ModelUnavailableError(f"{path} changed while it was being loaded; try again")
        self._loaded = before
        return model

    def _live_identity(self) -> Any:
        from promptstore._live import module_identity

        return module_identity(self._model, entries=("encode_text", "forward"), what="the text tower")

    def _record_built(self) -> None:
        self._built = self._live_identity()

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
        # A text's length ends at its end-of-text token. Counting non-zero ids is wrong: id 0
        # is a real BPE token ("!" before some punctuation, e.g. "stop!~").
        lengths = _eot_lengths(tokens, getattr(self, "eot_id", None))
        order = torch.argsort(lengths, stable=True)
        out = np.empty((len(texts), self.dim), np.float32)
        bar = tqdm(total=len(texts), desc="promptstore: encoding class names", unit="name",
                   disable=None if len(texts) > 2 * self.batch else True, leave=False)
        with torch.inference_mode():
            for start in range(0, len(texts), self.batch):
                idx = order[start : start + self.batch]
                batch = tokens[idx]
                if self.trim:
                    # Only for towers proven causal and pooled at the end-of-text token (see
                    # _trim_exact): no position sees what follows it, so the padding past the
                    # batch's longest text changes nothing (tests/test_vision_transparency.py).
                    batch = batch[:, : int(lengths[idx].max())]
                feats = self._forward(batch).float()
                out[idx.numpy()] = torch.nn.functional.normalize(feats, dim=-1).cpu().numpy()
                bar.update(len(idx))
        bar.close()
        return out


def _eot_lengths(tokens: Any, eot_id: int | None) -> Any:
    """Tokens up to and including each row's first end-of-text token (the whole row if none)."""
    import torch

    n = tokens.shape[1]
    if eot_id is None:
        return torch.full((tokens.shape[0],), n, dtype=torch.long)
    is_eot = tokens == eot_id
    first = is_eot.int().argmax(dim=1) + 1
    return torch.where(is_eot.any(dim=1), first, torch.full_like(first, n))


def _text_cfg(model_name: str) -> dict[str, Any]:
    import open_clip

    return dict(open_clip.get_model_config(model_name).get("text_cfg", {}))


def _trim_exact(text_cfg: dict[str, Any]) -> bool:
    """Whether cutting the context to a batch's longest text gives the 77-token features.

    True only for open_clip's own text transformer with a causal mask, no appended CLS token
    (CoCa) and pooling at the end-of-text token. Bidirectional towers (MobileCLIP2-S0/L-14,
    SigLIP) and last-token pooling see the padding, so trimming changes their features.
    """
    return (not text_cfg.get("no_causal_mask", False) and not text_cfg.get("embed_cls", False)
            and text_cfg.get("pool_type", "argmax") in ("argmax", "eos") and "hf_model_name" not in text_cfg)


class OpenCLIPTextEncoder(_BatchedEncoder):
    """An open_clip text tower, e.g. ``MobileCLIP2-B``.

    Features equal open_clip's own ``encode_text`` on the full context, L2-normalised. The
    context is cut to each batch's longest text only for towers where that is exact (causal,
    pooled at the end-of-text token); the fingerprint says which was run.

    Args:
        model_name: an open_clip architecture name using open_clip's BPE tokenizer.
        pretrained: None for a deterministic random init of the text tower from ``seed`` (the
            vision tower is never built); an open_clip tag; or a checkpoint path
            (fingerprinted by its digest).
        seed: the random-init seed.
        device: where to run.
        batch: texts per forward pass.
        trim: allow trimming where it is exact. False always runs the full context.

    Raises:
        InvalidInputError: unknown model name.
        UnsupportedModelError: a tower with a Hugging Face tokenizer or text model (they need
            the hub, and their padding-sensitive outputs are not reproduced here).
    """

    def __init__(self, model_name: str = "MobileCLIP2-B", pretrained: str | os.PathLike[str] | None = None,
                 seed: int = 0, device: str = "cpu", batch: int = 64, trim: bool = True) -> None:
        import open_clip

        if model_name not in open_clip.list_models():
            raise InvalidInputError(f"unknown open_clip model {model_name!r}")
        cfg = open_clip.get_model_config(model_name)
        text_cfg = dict(cfg.get("text_cfg", {}))
        if "hf_model_name" in text_cfg or "hf_tokenizer_name" in text_cfg:
            raise UnsupportedModelError(
                f"open_clip model {model_name!r} uses a Hugging Face text tower or tokenizer "
                f"({text_cfg.get('hf_model_name') or text_cfg.get('hf_tokenizer_name')}); promptstore serves towers "
                "with open_clip's own BPE tokenizer")
        self.model_name, self.pretrained, self.seed = model_name, pretrained, seed
        self.device, self.batch = device, batch
        self.trim = bool(trim) and _trim_exact(text_cfg)
        self._cfg = cfg
        self._model: Any = None
        self._dim = int(cfg["embed_dim"])
        self.eot_id: int | None = None
        if pretrained is None:
            import torch

            # A random init is fixed by the architecture, the seed and the code that draws it.
            source = (f"random-text-tower:seed={seed}:open_clip={open_clip.__version__}"
                      f":torch={torch.__version__.split('+')[0]}")
        elif Path(pretrained).is_file():
            source = f"file:{{file}}:open_clip={open_clip.__version__}"  # the bytes loaded, or on disk until then
        else:
            source = f"tag:{pretrained}:open_clip={open_clip.__version__}"  # its code pools and projects
        # The context actually run changes the features of some towers: it is part of the name.
        self._fp = f"open_clip:{model_name}:{source}:context={'trimmed' if self.trim else 'full'}"

    def _source_fingerprint(self) -> str:
        if "{file}" not in self._fp:
            return self._fp
        # A file gone before any build keys nothing that could have been computed from it.
        return self._fp.replace("{file}", self._file_digest() or f"missing:{self.pretrained}")

    def _weights_file(self) -> Path | None:
        if self.pretrained is None or not Path(self.pretrained).is_file():
            return None
        return Path(self.pretrained)

    @property
    def random_weights(self) -> bool:
        """True when the weights are a random init (shapes and cost are real, features are not)."""
        return self.pretrained is None

    def _build(self) -> Any:
        if self._model is None:
            import open_clip
            import torch

            try:
                # The caller's random stream is left as it was (open_clip initialises every layer at random,
                # checkpoint or not): building the tower is not a draw of the encoder's (_verify.Generators).
                with torch.random.fork_rng(devices=[]):
                    if self.pretrained is None:
                        torch.default_generator.manual_seed(self.seed)  # the CPU's only: the tower is built there
                        model = _random_text_tower(self._cfg).to(self.device)
                    else:
                        model = self._load_file(lambda: open_clip.create_model(
                            self.model_name, pretrained=str(self.pretrained), device=self.device))
            except RuntimeError as exc:
                raise ModelUnavailableError(f"cannot load open_clip weights {self.pretrained!r}: {exc}") from exc
            self._model = model.eval()
            self._tokenizer = open_clip.get_tokenizer(self.model_name)
            self.eot_id = getattr(self._tokenizer, "eot_token_id", None)
            self._record_built()
        return self._model

    def _tokenize(self, texts: list[str]) -> Any:
        self._build()
        return self._tokenizer(texts)

    def _forward(self, tokens: Any) -> Any:
        model = self._build()
        tokens = tokens.to(self.device)
        if tokens.shape[1] == self._tokenizer.context_length or not self.trim:
            out = model.encode_text(tokens) if hasattr(model, "encode_text") else model(tokens)
            return out[0] if isinstance(out, tuple) else out
        return _trimmed_forward(getattr(model, "text", model), tokens)


def _random_text_tower(cfg: dict[str, Any]) -> Any:
    """open_clip's text tower alone, randomly initialised exactly as open_clip builds it."""
    from open_clip.model import _build_text_tower

    return _build_text_tower(cfg["embed_dim"], dict(cfg.get("text_cfg", {})), quick_gelu=cfg.get("quick_gelu", False))


def _trimmed_forward(text: Any, tokens: Any) -> Any:
    """open_clip's causal text forward on a context cut to ``tokens.shape[1]``.

    open_clip slices its causal mask only in pad-mask mode, so the tower's own forward cannot
    take a shorter context; this is the same computation with mask and positions sliced.
    """
    import torch

    n = tokens.shape[1]
    cast = text.transformer.get_cast_dtype() if hasattr(text.transformer, "get_cast_dtype") else None
    x = text.token_embedding(tokens)
    x = (x.to(cast) if cast is not None else x) + text.positional_embedding[:n].to(x.dtype)
    x = text.ln_final(text.transformer(x, attn_mask=text.attn_mask[:n, :n]))
    x = x[torch.arange(x.shape[0], device=x.device), tokens.argmax(dim=-1)]  # the end-of-text token
    proj = text.text_projection
    if proj is None:
        return x
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

    def _source_fingerprint(self) -> str:
        if self._model is not None and self._loaded is not None:
            return f"ultralytics:{self.variant}:file:{self._loaded}"
        if self.weights is not None and self.weights.is_file():
            return f"ultralytics:{self.variant}:file:{file_digest(self.weights)}"
        return f"ultralytics:{self.variant}:published:{self.file_name}"

    def _weights_file(self) -> Path | None:
        return self.weights

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
                self._model = self._load_file(lambda: torch.jit.load(str(self.weights), map_location=self.device)).eval()
            self._record_built()
        return self._model

    def _tokenize(self, texts: list[str]) -> Any:
        import open_clip

        return open_clip.tokenize(texts)  # truncates to 77 tokens like clip.tokenize(truncate=True)

    def _forward(self, tokens: Any) -> Any:
        return self._build()(tokens.to(self.device))
