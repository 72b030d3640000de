"""Logistic regression over a whole C grid at once, in torch: the GPU path of the transfer fit.

The problem for each C_k of the grid is scikit-learn's ``LogisticRegression`` objective with an
unpenalised intercept (as its ``saga`` and ``lbfgs`` solvers have)::

    P_k(w, b) = sum_i [log(1 + exp(z_ik)) - y_i z_ik] + R(w) / C_k,   z_ik = x_i . w + b
    R(w) = ||w||_1 (penalty "l1") or ||w||_2^2 / 2 (penalty "l2")

(scikit-learn writes ``C sum_i loss_i + R(w)``: the same minimiser, C times the value). All k are
solved together by FISTA (Beck & Teboulle 2009, "A Fast Iterative Shrinkage-Thresholding
Algorithm for Linear Inverse Problems") with its backtracking line search, step sizes that may
also grow again (Scheinberg, Goldfarb & Bai 2014, "Fast First-Order Methods for Composite Convex
Optimization with Backtracking") and gradient-based adaptive restart (O'Donoghue & Candes 2015,
"Adaptive Restart for Accelerated Gradient Schemes"). The K weight vectors are the rows of one
[K, D] matrix, so an iteration is two GEMMs over the data whatever K is: ``(sigmoid(Z) - y) X``
for the gradients and ``W X^T`` for the new margins (the extrapolated point's margins are the
same linear combination of two margin matrices as its weights: no GEMM of their own). Each row
has its own step size and momentum; a row that has converged leaves the working set.

Stopping rule: the relative duality gap. The Fenchel dual of P_k is
``D_k(u) = -sum_i H(u_i + y_i)`` with ``H(q) = q log q + (1 - q) log(1 - q)``, over u with
``sum_i u_i = 0`` (the free intercept) and ``||X^T u||_inf <= 1/C_k`` (l1; for l2 the dual adds
``-C_k ||X^T u||^2 / 2``). Every ``check_every`` iterations the residuals ``u = sigmoid(z) - y``
of the current iterate, made feasible (see :func:`_gap`), give a dual point, and a row stops once
``(P - D) / P <= tol``: its objective is then within ``tol`` (relative) of the optimum, whatever
the conditioning. That costs one more GEMM per check.

Rows whose C is at most ``1 / max_j |X_j^T (y - mean(y))|`` (l1) have the closed-form solution
w = 0, b = logit(mean(y)) (the unpenalised-intercept form of :func:`sklearn.svm.l1_min_c`) and are
not iterated at all.

Runs on the device the features are moved to (CUDA when asked for or, with ``auto``, when
present), in float32 by default; losses, the line-search test and the gap are summed in float64.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

PENALTIES = ("l1", "l2")


@dataclass
class TorchPath:
    """Solutions of :func:`fit_path`, one row per C (in the order given).

    Attributes:
        coef: float64 [K, D] weights.
        intercept: float64 [K].
        n_iter: int64 [K] iterations (0 for the closed-form zero solutions).
        converged: bool [K]: the relative duality gap reached ``tol`` within ``max_iter``.
        objective: float64 [K] the primal objective ``sum_i loss_i + R(w) / C`` at the solution.
        gap: float64 [K] relative duality gap ``(P - D) / P`` at the solution (an upper bound on
            the relative distance of ``objective`` to the optimum).
        gemms: passes over the data (GEMMs with X) of the whole solve.
        device: the device it ran on, e.g. ``"cuda:0"`` or ``"cpu"``.
        seconds: wall time (CUDA synchronised), moving the data to the device included.
    """

    coef: np.ndarray
    intercept: np.ndarray
    n_iter: np.ndarray
    converged: np.ndarray
    objective: np.ndarray
    gap: np.ndarray
    gemms: int
    device: str
    seconds: float


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``None``/``"auto"`` -> ``cuda`` when torch sees a GPU, else ``cpu``; anything else as
    given.

    Raises:
        ValueError: CUDA asked for and not available.
    """
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"fit device {device!r} asked for, but torch sees no CUDA device")
    return dev


def _loss(Z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Summed logistic loss per row, float64 [k], of margins Z [k, N] for labels y [1, N]:
    ``softplus(z) - y z = softplus((1 - 2y) z)``, the form without cancellation, in float64."""
    return torch.nn.functional.softplus((1 - 2 * y.double()) * Z.double()).sum(1)


def _reg(W: torch.Tensor, penalty: str) -> torch.Tensor:
    """R(w) per row, float64 [k]."""
    Wd = W.double()
    return Wd.abs().sum(1) if penalty == "l1" else 0.5 * (Wd * Wd).sum(1)


def _best_intercept(Z0: torch.Tensor, y: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The intercept b* [k, 1] (float64) minimising the loss of margins ``Z0 + b*`` (Z0 [k, N]
    without intercept), i.e. solving sum_i sigmoid(z0_i + b*) = sum_i y_i, by safeguarded Newton
    steps from ``b``."""
    Z0, b, n_pos = Z0.double(), b.double(), y.double().sum()
    for _ in range(30):
        p = torch.sigmoid(Z0 + b)
        g = p.sum(1, keepdim=True) - n_pos
        h = (p * (1 - p)).sum(1, keepdim=True).clamp(min=1e-12)
        b = b - torch.clamp(g / h, -2.0, 2.0)
        if float(g.abs().max()) <= 1e-9 * float(n_pos):
            break
    return b


def _gap(Z: torch.Tensor, W: torch.Tensor, y: torch.Tensor, X: torch.Tensor,
         invC: torch.Tensor, penalty: str) -> torch.Tensor:
    """Relative duality gap (P - D) / P per row (float64 [k]) at weights W [k, D] with margins
    Z [k, N] (float64; see the module docstring; one GEMM).

    The dual point is the residual u = sigmoid(z) - y, made feasible without leaving the
    domain (u_i + y_i in [0, 1]): the residuals of one class (u > 0 where y = 0, u < 0 where
    y = 1) are scaled down so that sum_i u_i = 0, then all by s <= 1 so that
    ``||X^T u||_inf <= 1/C`` (l1). Both scalings keep ``u_i + y_i`` between ``y_i`` and
    ``sigmoid(z_i)``, so D(u) is a true lower bound and the gap a certificate."""
    yd = y.double()
    primal = _loss(Z, y) + invC * _reg(W, penalty)
    u = torch.sigmoid(Z) - yd  # [k, N]
    pos, neg = u.clamp(min=0), u.clamp(max=0)
    sp, sn = pos.sum(1, keepdim=True), -neg.sum(1, keepdim=True)
    u = pos * torch.clamp(sn / sp.clamp(min=1e-300), max=1.0) \
        + neg * torch.clamp(sp / sn.clamp(min=1e-300), max=1.0)
    XTu = (u.to(X.dtype) @ X).double()  # [k, D]
    if penalty == "l1":
        s = torch.clamp(invC / XTu.abs().amax(1).clamp(min=1e-300), max=1.0)
        quad = torch.zeros_like(s)
    else:
        s = torch.ones_like(invC)
        quad = 0.5 / invC * (XTu * XTu).sum(1)
    q = (s.unsqueeze(1) * u + yd).clamp(0, 1)  # clamp: float rounding only
    neg_entropy = (torch.xlogy(q, q) + torch.xlogy(1 - q, 1 - q)).sum(1)
    dual = -neg_entropy - s * s * quad
    return (primal - dual) / primal.abs().clamp(min=1e-300)


def _lipschitz(X: torch.Tensor, iters: int = 10, seed: int = 0) -> float:
    """Estimate of lambda_max([X, 1]^T [X, 1]) / 4, the summed logistic loss's gradient
    Lipschitz constant, by power iteration (a lower bound: the line search raises L where
    needed)."""
    N, D = X.shape
    g = torch.Generator(device="cpu").manual_seed(seed)
    v = torch.randn(1, D + 1, generator=g, dtype=torch.float64).to(X.device, X.dtype)
    v = v / v.norm()
    est = 4.0
    for _ in range(iters):
        u = v[:, :D] @ X.t() + v[:, D:]  # [1, N]
        w = torch.cat([u @ X, u.sum(1, keepdim=True)], 1)
        est = float(w.norm())
        if est == 0:
            return 1.0
        v = w / est
    return est / 4


def fit_path(X, y, Cs: Sequence[float], penalty: str = "l1", tol: float = 1e-3,
             max_iter: int = 20000, device: str | torch.device | None = None,
             dtype: torch.dtype = torch.float32, check_every: int = 10,
             shrink: float = 0.95) -> TorchPath:
    """Logistic regression for every C of ``Cs`` at once (see the module docstring).

    Args:
        X: features [N, D] (numpy or torch; moved to ``device`` as ``dtype``).
        y: labels [N] in {0, 1}.
        Cs: K inverse regularisation strengths (scikit-learn's C), each > 0, any order.
        penalty: ``l1`` (sparse; the prox is soft thresholding) or ``l2``.
        tol: stop a row at this relative duality gap (a certified bound on the objective's
            relative distance to the optimum; the gap of this dual point is loose: at 1e-3 the
            measured distance was 1e-5 or less on the test problems).
        max_iter: iterations at most (rows not converged by then come back with ``converged``
            False).
        device: ``auto``/None (CUDA if available), ``cpu``, ``cuda``, ``cuda:N``.
        dtype: compute dtype of the data and weights (float32; float64 for reference runs).
        check_every: iterations between duality-gap checks.
        shrink: each iteration first tries L x ``shrink`` (a longer step), then doubles L until
            the sufficient-decrease test holds (1.0: L only grows, Beck & Teboulle's rule, which
            took 3.7x the GEMMs of 0.95 on a 2,000 x 1,000 problem; 0.5 diverged).
    Returns:
        :class:`TorchPath`.
    Raises:
        ValueError: bad penalty, empty grid, C <= 0, labels not 0/1 or of one class only, shape
            mismatch, CUDA unavailable.
    """
    if penalty not in PENALTIES:
        raise ValueError(f"penalty must be one of {PENALTIES}, got {penalty!r}")
    Cs = np.asarray(list(Cs), dtype=np.float64)
    if Cs.size == 0 or not np.all(Cs > 0) or not np.all(np.isfinite(Cs)):
        raise ValueError(f"C values must be finite and > 0, got {Cs.tolist()}")
    dev = resolve_device(device)
    t0 = time.perf_counter()
    Xt = torch.as_tensor(X).to(dev, dtype).contiguous()
    yn = np.asarray(y).ravel()
    if Xt.ndim != 2 or Xt.shape[0] != yn.shape[0]:
        raise ValueError(f"X {tuple(Xt.shape)} and y {yn.shape} do not match")
    if not np.isin(yn, (0, 1)).all() or len(np.unique(yn)) < 2:
        raise ValueError("labels must be 0/1 with both classes present")
    N, D = Xt.shape
    K = len(Cs)
    yt = torch.as_tensor(yn.astype(np.float64)).to(dev, dtype).unsqueeze(0)  # [1, N]
    ybar = float(yn.mean())
    gmax = float(((yt - ybar) @ Xt).abs().max())  # ||X^T (y - ybar)||_inf: gradient at zero
    b0 = math.log(ybar / (1 - ybar))
    gemms = 2

    coef = np.zeros((K, D))
    intercept = np.full(K, b0)
    n_iter = np.zeros(K, dtype=np.int64)
    converged = np.zeros(K, dtype=bool)
    gap_out = np.zeros(K)
    # l1: C <= 1 / max|X^T (y - ybar)| -> w = 0 is optimal; no features at all -> the same.
    zero = (Cs * gmax <= 1.0) if penalty == "l1" else np.full(K, gmax == 0.0)
    converged[zero] = True
    idx = np.flatnonzero(~zero)  # original row of each working row

    if idx.size:
        k = idx.size
        invC = torch.as_tensor(1.0 / Cs[idx], device=dev)  # float64 [k]
        lam = invC.to(dtype).unsqueeze(1)  # [k, 1]
        L = torch.full((k,), _lipschitz(Xt), device=dev, dtype=torch.float64)
        gemms += 20
        if penalty == "l2":
            L = L + invC
        W = torch.zeros(k, D, device=dev, dtype=dtype)
        b = torch.full((k, 1), b0, device=dev, dtype=dtype)
        Z = (W @ Xt.t()).double() + b.double()  # [k, N], float64 (see below)
        gemms += 1
        Wv, bv, Zv = W.clone(), b.clone(), Z.clone()
        t = torch.ones(k, device=dev, dtype=torch.float64)
        # Margins are kept in float64: the extrapolated point's margins are a linear combination
        # of two GEMM results, and in float32 its rounding alone could fail the sufficient-
        # decrease test near the optimum. The test still allows the float32 GEMMs' rounding
        # (1e-5 of the loss: at 1e-6 the largest C of a 6,920 x 4,096 problem stalled before
        # reaching the gap tolerance), far below that tolerance.
        slack = 1e-5 if dtype == torch.float32 else 1e-12
        it = 0
        while idx.size and it < max_iter:
            it += 1
            P = (torch.sigmoid(Zv) - yt.double()).to(dtype)  # [k, N]
            fV = _loss(Zv, yt)
            G = P @ Xt  # [k, D]
            gemms += 1
            if penalty == "l2":
                fV = fV + invC * _reg(Wv, penalty)
                G = G + lam * Wv
            gb = P.sum(1, keepdim=True)
            L_prev = L
            L = L * shrink
            for _ in range(60):  # backtracking until sufficient decrease (Beck & Teboulle)
                step = (1.0 / L).to(dtype).unsqueeze(1)
                Wn = Wv - G * step
                if penalty == "l1":
                    Wn = torch.sign(Wn) * torch.clamp(Wn.abs() - lam * step, min=0)
                bn = bv - gb * step
                Zn = (Wn @ Xt.t()).double() + bn.double()
                gemms += 1
                fN = _loss(Zn, yt)
                if penalty == "l2":
                    fN = fN + invC * _reg(Wn, penalty)
                dW, db = (Wn - Wv).double(), (bn - bv).double().squeeze(1)
                Q = fV + (G.double() * dW).sum(1) + gb.double().squeeze(1) * db \
                    + 0.5 * L * ((dW * dW).sum(1) + db * db)
                bad = fN > Q + slack * fV.abs()  # slack: float rounding of the GEMMs
                if not bool(bad.any()):
                    break
                L = torch.where(bad, 2 * L, L)
            # No step decreases the objective any more (float precision): the row is done.
            stalled = bad | ~torch.isfinite(L)
            # Gradient restart (O'Donoghue & Candes 2015): momentum pointing uphill -> reset.
            restart = ((Wv - Wn).double() * (Wn - W).double()).sum(1) \
                + ((bv - bn).double() * (bn - b).double()).squeeze(1) > 0
            t = torch.where(restart, torch.ones_like(t), t)
            t_next = (1 + torch.sqrt(1 + 4 * (L / L_prev) * t * t)) / 2
            beta = ((t - 1) / t_next).to(dtype).unsqueeze(1)
            Wv = Wn + beta * (Wn - W)
            bv = bn + beta * (bn - b)
            Zv = Zn + beta.double() * (Zn - Z)
            W, b, Z, t = Wn, bn, Zn, t_next
            if it % check_every and it < max_iter and not bool(stalled.any()):
                continue
            # The intercept is one variable: certify (W, its exact best b) rather than (W, b).
            b_opt = _best_intercept(Z - b, yt, b)
            gap = _gap(Z - b.double() + b_opt, W, yt, Xt, invC, penalty)
            gemms += 1
            done = ((gap <= tol) | stalled | (it >= max_iter)).cpu().numpy()
            if done.any():
                d = torch.as_tensor(np.flatnonzero(done), device=dev)
                rows = idx[done]
                coef[rows] = W[d].double().cpu().numpy()
                intercept[rows] = b_opt[d, 0].cpu().numpy()
                n_iter[rows] = it
                gap_out[rows] = gap[d].cpu().numpy()
                converged[rows] = gap_out[rows] <= tol
                keep = torch.as_tensor(np.flatnonzero(~done), device=dev)
                idx = idx[~done]
                W, b, Z, Wv, bv, Zv = W[keep], b[keep], Z[keep], Wv[keep], bv[keep], Zv[keep]
                t, L, lam, invC = t[keep], L[keep], lam[keep], invC[keep]
    objective = objective_values(Xt, yn, coef, intercept, Cs, penalty) / Cs
    if zero.any():  # the zero rows' gap: their objective is exact, the gap 0
        gap_out[zero] = 0.0
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return TorchPath(coef, intercept, n_iter, converged, objective, gap_out, gemms, str(dev),
                     time.perf_counter() - t0)


def objective_values(X, y, coef: np.ndarray, intercept: np.ndarray, Cs: Sequence[float],
                     penalty: str = "l1") -> np.ndarray:
    """scikit-learn's ``LogisticRegression`` objective, ``C_k sum_i loss_i + R(w_k)``, for each
    row of ``coef`` [K, D] / ``intercept`` [K] and C of ``Cs``, in float64 (the loss as
    ``softplus(z) - y z``, which is ``log(1 + exp(-y' z))`` for y' = 2y - 1).

    Args:
        X: [N, D] numpy or torch (any device); y: [N] labels 0/1 (numpy).
    Returns:
        float64 [K].
    """
    Xd = torch.as_tensor(X).double()
    dev = Xd.device
    yd = torch.as_tensor(np.asarray(y, dtype=np.float64).reshape(1, -1)).to(dev)
    Wd = torch.as_tensor(np.asarray(coef, dtype=np.float64)).to(dev)
    bd = torch.as_tensor(np.asarray(intercept, dtype=np.float64)).to(dev).reshape(-1, 1)
    Zd = Wd @ Xd.t() + bd
    loss = _loss(Zd, yd).cpu().numpy()
    reg = _reg(Wd, penalty).cpu().numpy()
    return np.asarray(Cs, dtype=np.float64) * loss + reg
