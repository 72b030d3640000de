"""The mLSTM forward pass against a plain numpy implementation of the equations."""
import numpy as np
import pytest
import torch

from hvd_lm.model.lm import LanguageModel, ModelConfig, parameter_shapes


def config(cell: str, **kw) -> ModelConfig:
    """``mlstm`` (the fused recurrence, default), ``mlstm-reference`` or ``lstm``."""
    if cell == "mlstm-reference":
        return ModelConfig(cell="mlstm", rnn_impl="reference", **kw)
    return ModelConfig(cell=cell, **kw)


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def numpy_mlstm_logits(model: LanguageModel, tokens: np.ndarray) -> np.ndarray:
    """Krause et al. 2016 mLSTM, written out in numpy from the effective weights."""
    sd = {k: v.detach().double().numpy() for k, v in model.named_parameters()}
    rnn = model.rnn
    W = {n: getattr(rnn, n).weight.detach().double().numpy()
         for n in ("w_x", "w_mx", "w_mh", "w_h")}
    b = rnn.w_x.bias.detach().double().numpy()
    emb = sd["embed.weight"]
    H = model.config.hidden_size
    B, T = tokens.shape
    h = np.zeros((B, H))
    c = np.zeros((B, H))
    out = []
    for t in range(T):
        x = emb[tokens[:, t]]
        m = (x @ W["w_mx"].T) * (h @ W["w_mh"].T)
        g = x @ W["w_x"].T + b + m @ W["w_h"].T
        i, f, u, o = g[:, :H], g[:, H:2 * H], g[:, 2 * H:3 * H], g[:, 3 * H:]
        c = sigmoid(f) * c + sigmoid(i) * np.tanh(u)
        h = sigmoid(o) * np.tanh(c)
        out.append(h @ sd["decoder.weight"].T + sd["decoder.bias"])
    return np.stack(out, 1)


@pytest.mark.parametrize("rnn_impl", ["fused", "reference"])
@pytest.mark.parametrize("weight_norm", [False, True])
def test_mlstm_forward_matches_numpy(weight_norm, rnn_impl):
    torch.manual_seed(0)
    model = LanguageModel(ModelConfig(hidden_size=16, embed_dim=8, weight_norm=weight_norm,
                                      rnn_impl=rnn_impl)).double()
    with torch.no_grad():  # non-trivial biases and weight-norm gains
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    tokens = np.random.default_rng(0).integers(0, 256, size=(3, 7))
    logits, (h, c) = model(torch.from_numpy(tokens))
    np.testing.assert_allclose(logits.detach().numpy(), numpy_mlstm_logits(model, tokens),
                               rtol=1e-10, atol=1e-10)
    assert logits.shape == (3, 7, 256) and h.shape == c.shape == (3, 16)


@pytest.mark.parametrize("cell", ["mlstm", "mlstm-reference", "lstm"])
def test_reset_equals_fresh_start(cell):
    torch.manual_seed(0)
    model = LanguageModel(config(cell, hidden_size=12, embed_dim=4))
    tokens = torch.randint(0, 256, (2, 9))
    state = model.init_state(2)
    state = (state[0] + 0.5, state[1] - 0.5)
    reset = torch.zeros(2, 9, dtype=torch.bool)
    reset[1, 4] = True
    hs, _ = model.encode(tokens, state, reset=reset)
    # Row 1 from position 4 equals a fresh run over tokens[1, 4:]; row 0 is untouched by it.
    fresh, _ = model.encode(tokens[1:, 4:])
    torch.testing.assert_close(hs[1:, 4:], fresh)
    whole, _ = model.encode(tokens, state)
    torch.testing.assert_close(hs[0], whole[0])
    assert not torch.allclose(hs[1, 4:], whole[1, 4:])


@pytest.mark.parametrize("cell", ["mlstm", "mlstm-reference", "lstm"])
def test_padding_never_changes_final_state(cell):
    torch.manual_seed(0)
    model = LanguageModel(config(cell, hidden_size=12, embed_dim=4))
    a = torch.randint(0, 256, (1, 5))
    b = torch.randint(0, 256, (1, 9))
    batch = torch.zeros(2, 9, dtype=torch.long)
    batch[0, :5], batch[1] = a[0], b[0]
    mask = torch.zeros(2, 9, dtype=torch.bool)
    mask[0, :5], mask[1] = True, True
    _, (h, c) = model.encode(batch, mask=mask)
    _, (ha, ca) = model.encode(a)
    torch.testing.assert_close(c[0], ca[0])
    torch.testing.assert_close(h[0], ha[0])


def test_config_rejects_bad_values():
    """A config built in code is checked when the model is built from it."""
    with pytest.raises(ValueError, match="cell"):
        LanguageModel(ModelConfig(cell="gru"))
    with pytest.raises(ValueError, match="hidden_size"):
        LanguageModel(ModelConfig(hidden_size=0))


@pytest.mark.parametrize("cell", ["mlstm", "lstm"])
def test_parameter_shapes_match_the_built_model(cell):
    """The analytic parameter list (what the scaling model and the allreduce bench use) equals
    the real model's named parameters, in order."""
    cfg = ModelConfig(cell=cell, hidden_size=24, embed_dim=8)
    built = [(n, tuple(p.shape)) for n, p in LanguageModel(cfg).named_parameters()]
    assert parameter_shapes(cfg) == built
