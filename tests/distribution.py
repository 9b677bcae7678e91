"""Goodness-of-fit helper for the distribution tests."""
import math


def chi_square_p_value(counts, probs, min_expected: float = 5.0) -> float:
    """p-value of Pearson's chi-square test of observed counts against probabilities.

    Cells whose expected count is below min_expected are pooled into one cell, so the chi-square
    approximation holds. A count in a zero-probability cell gives p = 0.
    """
    counts, probs = [float(c) for c in counts], [float(p) for p in probs]
    n = sum(counts)
    if any(c > 0 and p == 0 for c, p in zip(counts, probs)):
        return 0.0
    cells, pooled_c, pooled_e = [], 0.0, 0.0
    for c, p in zip(counts, probs):
        if p * n >= min_expected:
            cells.append((c, p * n))
        else:
            pooled_c, pooled_e = pooled_c + c, pooled_e + p * n
    if pooled_e > 0:
        cells.append((pooled_c, pooled_e))
    stat = sum((c - e) ** 2 / e for c, e in cells)
    dof = max(len(cells) - 1, 1)
    # Wilson-Hilferty approximation of the chi-square survival function
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def first_two_joint(model_path: str, prompt: list[int]) -> dict:
    """P(t0, t1) of the model alone at temperature 1 after `prompt`, as {(t0, t1): p}; (eos, None) when t0 is
    EOS."""
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_path).eval()
    eos = model.generation_config.eos_token_id
    with torch.no_grad():
        p0 = torch.softmax(model(torch.tensor([prompt])).logits[0, -1].double(), -1)
        joint = {}
        for t0 in range(p0.shape[0]):
            if t0 == eos:
                joint[(t0, None)] = float(p0[t0])
                continue
            p1 = torch.softmax(model(torch.tensor([prompt + [t0]])).logits[0, -1].double(), -1)
            joint.update({(t0, t1): float(p0[t0] * p1[t1]) for t1 in range(p1.shape[0])})
    return joint
