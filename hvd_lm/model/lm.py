"""The byte-level language model: a multiplicative LSTM (or a plain LSTM for comparison).

mLSTM (Krause et al. 2016, "Multiplicative LSTM for sequence modelling"), as used by Radford et al.
2017 ("Learning to Generate Reviews and Discovering Sentiment") and NVIDIA/sentiment-discovery's
``mLSTMCell``. For input embedding x_t [B, E] and state (h, c) [B, H]:

    m_t = (W_mx x_t) * (W_mh h_{t-1})                  intermediate state, [B, H]
    [i, f, u, o] = W_x x_t + W_h m_t + b               four gates, [B, 4H] (reference order)
    c_t = sigmoid(f) * c_{t-1} + sigmoid(i) * tanh(u)
    h_t = sigmoid(o) * tanh(c_t)

Fused gate matmuls: the input terms W_x x_t and W_mx x_t of all T steps are one [T*B, E] x [E, 5H]
matmul before the recurrence; each step then does two [B, H] x [H, *] matmuls. Optional weight
normalisation (Salimans & Kingma 2016) of the four recurrent/gate weights, as the reference.
Logits are a linear map of h_t onto the 256 byte values.

Two implementations of the recurrence (``ModelConfig.rnn_impl``): ``fused`` (default), the whole
window as one autograd Function with fused per-step cell kernels and weight gradients as single
GEMMs (:mod:`hvd_lm.model.mlstm_fused`), and ``reference``, the step-by-step autograd code below,
kept as the oracle the fused one is tested against.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.nn.utils.parametrizations import weight_norm as wn

from hvd_lm.model.config import ModelConfig  # noqa: F401 - the model's settings, here too
from hvd_lm.model.mlstm_fused import WindowGraphs, default_layout, mlstm_window, project
from hvd_lm.model.mlstm_kernels import get_kernels
from hvd_lm.options import validate

State = tuple[torch.Tensor, torch.Tensor]


class MLSTM(nn.Module):
    """One mLSTM layer over a whole sequence (see the module docstring for the equations).

    Parameters (names follow sentiment-discovery): ``w_x`` [4H, E] with bias ``b`` [4H],
    ``w_mx`` [H, E], ``w_mh`` [H, H], ``w_h`` [4H, H].

    Args:
        impl: ``fused`` (:mod:`hvd_lm.model.mlstm_fused`) or ``reference`` (the per-step loop
            at the end of :meth:`forward`, the oracle).
        kernels: the fused path's cell kernels (:data:`hvd_lm.model.config.KERNELS`).
        cuda_graphs: replay the fused window from a CUDA graph on CUDA (see
            :class:`hvd_lm.model.mlstm_fused.WindowGraphs`).
    """

    def __init__(self, input_size: int, hidden_size: int, weight_norm: bool = False,
                 impl: str = "fused", kernels: str = "auto", cuda_graphs: bool = False):
        super().__init__()
        self.hidden_size, self.impl, self.kernels = hidden_size, impl, kernels
        self.graphs = WindowGraphs() if cuda_graphs else None
        self.w_x = nn.Linear(input_size, 4 * hidden_size, bias=True)
        self.w_mx = nn.Linear(input_size, hidden_size, bias=False)
        self.w_mh = nn.Linear(hidden_size, hidden_size, bias=False)
        self.w_h = nn.Linear(hidden_size, 4 * hidden_size, bias=False)
        bound = hidden_size ** -0.5
        for name in ("w_x", "w_mx", "w_mh", "w_h"):
            nn.init.uniform_(getattr(self, name).weight, -bound, bound)
            if weight_norm:
                setattr(self, name, wn(getattr(self, name), dim=0))
        # Bias 0, the forget gate's 1 (Jozefowicz et al. 2015): long memory from the first step.
        with torch.no_grad():
            self.w_x.bias.zero_()[hidden_size:2 * hidden_size] = 1.0

    def forward(self, x: Tensor, state: State, mask: Tensor | None = None,
                reset: Tensor | None = None) -> tuple[Tensor, State]:
        """Run the recurrence.

        Args:
            x: inputs [T, B, E] (contiguous: the input projections' bias is then added inside
                their GEMM, :func:`hvd_lm.model.mlstm_fused.project`).
            state: (h, c), each [B, H].
            mask: optional bool [T, B]; where False the step is padding and the state is carried
                unchanged (so a padded batch gives the same final state as each text alone).
            reset: optional bool [T, B]; True zeroes that row's state before that step (fused
                path only: :meth:`LanguageModel.encode` splits the window into segments for the
                reference path).

        Returns:
            (hs [T, B, H], (h_T, c_T)); the fused path returns hs in the compute dtype (bf16/fp16
            under autocast) and (h_T, c_T) in the incoming state's dtype.

        Raises:
            ValueError: ``reset`` given to the reference path.
        """
        if self.impl == "fused":
            kernels = get_kernels(self.kernels, x.device)
            layout = default_layout(x.device, kernels)
            # [T, B, 4H], [T, B, H]: one GEMM each, stored as the window stores its steps
            xg = project(x, self.w_x.weight, self.w_x.bias, layout)
            xm = project(x, self.w_mx.weight, None, layout)
            # Weight norm (when on) is applied here, once per window; the Function casts once.
            return mlstm_window(xg, xm, state, self.w_mh.weight, self.w_h.weight, kernels,
                                mask, reset, self.graphs, layout, owned=True)
        if reset is not None:
            raise ValueError("MLSTM reference path: resets are applied by LanguageModel.encode")
        # The step-by-step recurrence (rnn_impl="reference", the oracle). Fused input projections
        # for all steps: [T, B, 4H] and [T, B, H] from one pass each; unbind, not xg[t]: the
        # backward of T unbind outputs is one stack, while T selects would each fill and add a
        # whole [T, B, 4H] zero gradient (docs/performance.md has its share of the step).
        w_mh, w_h = self.w_mh.weight.t(), self.w_h.weight.t()
        h, c = state
        outs = []
        for t, (xg, xm) in enumerate(zip(self.w_x(x).unbind(0), self.w_mx(x).unbind(0))):
            m = xm * (h @ w_mh)
            i, f, u, o = (xg + m @ w_h).split(self.hidden_size, dim=1)
            c_new = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(u)
            h_new = torch.sigmoid(o) * torch.tanh(c_new)
            if mask is not None:
                keep = mask[t].unsqueeze(1)
                c_new = torch.where(keep, c_new, c)
                h_new = torch.where(keep, h_new, h)
            h, c = h_new, c_new
            outs.append(h)
        return torch.stack(outs), (h, c)


class LanguageModel(nn.Module):
    """Byte embedding -> recurrent layer -> 256 logits.

    ``forward(tokens [B, T] int64, state) -> (logits [B, T, 256], state)``; state is (h, c), each
    [B, H], carried across consecutive TBPTT windows by the caller (detached) and reset at stream
    starts with :meth:`init_state`.

    Raises:
        hvd_lm.options.ConfigError: a field of ``config`` outside its declared choices or
            bounds (a config built in code; flags and YAML are checked where they are read,
            naming their source).
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        validate(config, "model")
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.embed_dim)
        if config.cell == "mlstm":
            self.rnn = MLSTM(config.embed_dim, config.hidden_size, config.weight_norm,
                             config.rnn_impl, config.rnn_kernels, config.cuda_graphs)
        else:
            self.rnn = nn.LSTM(config.embed_dim, config.hidden_size)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size)

    def init_state(self, batch_size: int, device: torch.device | str = "cpu",
                   dtype: torch.dtype = torch.float32) -> State:
        """Zero state (h, c), each [batch_size, H]."""
        z = torch.zeros(batch_size, self.config.hidden_size, device=device, dtype=dtype)
        return z, z.clone()

    def encode(self, tokens: Tensor, state: State | None = None, mask: Tensor | None = None,
               reset: Tensor | None = None, time_major: bool = False) -> tuple[Tensor, State]:
        """Hidden states of ``tokens`` [B, T] (int64 byte ids).

        The data stays in [T, B] order from the embedding to the output (the embedding of
        ``tokens.t()`` is contiguous [T, B, E], the recurrence returns contiguous [T, B, H]), so
        no [T, B, *] transpose is copied on the way, forward or backward; ``time_major=False``
        returns a transposed view.

        Args:
            state: (h, c), each [B, H]; None = zeros.
            mask: optional bool [B, T], False on padding (mLSTM: state held; see :class:`MLSTM`).
                For the plain LSTM padding must be at the end; it is handled with packed sequences.
            reset: optional bool [B, T]; True zeroes that row's state before that position (a
                stream or shard start inside the window). The fused mLSTM applies it inside its
                window; the reference mLSTM and the LSTM run the window in segments split at the
                reset columns.
            time_major: return hs as contiguous [T, B, H] instead of a [B, T, H] view of it.

        Returns:
            (hs [B, T, H] (or [T, B, H]), (h, c) each [B, H]).
        """
        B, T = tokens.shape
        if state is None:
            state = self.init_state(B, tokens.device, self.embed.weight.dtype)
        fused = isinstance(self.rnn, MLSTM) and self.rnn.impl == "fused"
        if not fused and reset is not None and bool(reset.any()):
            edges = sorted({0, *torch.nonzero(reset.any(0)).flatten().tolist(), T})
            outs = []
            for a, b in zip(edges[:-1], edges[1:]):
                keep = (~reset[:, a]).unsqueeze(1).to(state[0].dtype)
                state = (state[0] * keep, state[1] * keep)
                hs, state = self.encode(tokens[:, a:b], state,
                                        None if mask is None else mask[:, a:b], time_major=True)
                outs.append(hs)
            hs = torch.cat(outs, 0)
        elif isinstance(self.rnn, MLSTM):
            hs, state = self.rnn(self.embed(tokens.t()), state,  # [T, B, E], contiguous
                                 None if mask is None else mask.t(),
                                 reset.t() if fused and reset is not None else None)
        else:
            x, hc = self.embed(tokens.t()), (state[0].unsqueeze(0), state[1].unsqueeze(0))
            if mask is not None:
                x = nn.utils.rnn.pack_padded_sequence(x, mask.sum(1).cpu(), enforce_sorted=False)
            hs, (h, c) = self.rnn(x, hc)
            if mask is not None:
                hs = nn.utils.rnn.pad_packed_sequence(hs, total_length=T)[0]
            state = (h[0], c[0])
        return (hs if time_major else hs.transpose(0, 1)), state

    def forward(self, tokens: Tensor, state: State | None = None, reset: Tensor | None = None,
                time_major: bool = False ) -> tuple[Tensor, State]:
        """Logits [B, T, 256] for next-byte prediction, and the final state (see :meth:`encode`);
        ``time_major``: logits as contiguous [T, B, 256] (the training step's loss reads them
        so, with the targets transposed: no copy of the logits)."""
        hs, state = self.encode(tokens, state, None, reset, time_major=True)
        logits = self.decoder(hs)  # one GEMM over [T*B, H], bias in its epilogue
        return (logits if time_major else logits.transpose(0, 1)), state

    def flops_per_char(self) -> int:
        """Model FLOPs per character for one forward + backward pass (3x the forward's multiply-adds
        x 2), counting the matmuls only (the usual convention, e.g. Kaplan et al. 2020): one
        multiply-add per element of each weight matrix (:func:`parameter_shapes`; the embedding
        is a lookup): mLSTM E x 5H + H x H + H x 4H + H x V, LSTM E x 4H + H x 4H + H x V."""
        return 3 * 2 * sum(math.prod(shape) for name, shape in parameter_shapes(self.config)
                           if len(shape) == 2 and name != "embed.weight")


def recurrence_label(rnn_impl: str, rnn_kernels: str = "auto", cuda_graphs: bool = False) -> str:
    """The mLSTM recurrence's name in the benchmarks' tables: ``reference`` (or another
    non-fused ``rnn_impl`` as it is), ``fused/<kernels>[+graphs]``."""
    return rnn_impl if rnn_impl != "fused" else f"fused/{rnn_kernels}{'+graphs' * cuda_graphs}"


def parameter_shapes(config: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of :class:`LanguageModel`'s parameters in registration order, computed
    from the config without building a model (``weight_norm`` off): embed [256, E]; mLSTM
    ``w_x`` [4H, E] + bias [4H], ``w_mx`` [H, E], ``w_mh`` [H, H], ``w_h`` [4H, H] (LSTM:
    ``weight_ih`` [4H, E], ``weight_hh`` [4H, H], two biases [4H]); decoder [256, H] + bias [256].
    """
    E, H, V = config.embed_dim, config.hidden_size, config.vocab_size
    if config.cell == "mlstm":
        rnn = [("rnn.w_x.weight", (4 * H, E)), ("rnn.w_x.bias", (4 * H,)),
               ("rnn.w_mx.weight", (H, E)), ("rnn.w_mh.weight", (H, H)),
               ("rnn.w_h.weight", (4 * H, H))]
    else:
        rnn = [("rnn.weight_ih_l0", (4 * H, E)), ("rnn.weight_hh_l0", (4 * H, H)),
               ("rnn.bias_ih_l0", (4 * H,)), ("rnn.bias_hh_l0", (4 * H,))]
    return [("embed.weight", (V, E)), *rnn, ("decoder.weight", (V, H)), ("decoder.bias", (V,))]


def mlstm_parameters(hidden_size: int, embed_dim: int = 64) -> list[tuple[str, int]]:
    """(name, element count) of the parameters of ``LanguageModel(ModelConfig(embed_dim=E,
    hidden_size=H))`` (an mLSTM) in registration order (:func:`parameter_shapes`): what the
    gradient allreduce moves, for the scaling model and the allreduce benchmark."""
    shapes = parameter_shapes(ModelConfig(hidden_size=hidden_size, embed_dim=embed_dim))
    return [(name, int(math.prod(shape))) for name, shape in shapes]

