"""[model]: multi-token prediction (`models.mtp`) against the model, the sequence and the loss."""

from megatrain.config.errors import ConfigError
from megatrain.config.sections import Config


def _check_mtp(config: Config) -> None:
    m, t = config.model, config.training
    depth = m.mtp_num_layers
    if depth is None:
        return
    if not (isinstance(depth, int) and not isinstance(depth, bool) and depth >= 1):
        raise ConfigError(
            f"model.mtp_num_layers must be a positive number of depths (unset: no multi-token "
            f"prediction), got {depth!r}"
        )
    if m.kind == "bert":
        raise ConfigError(
            "model.mtp_num_layers with model.kind = 'bert': multi-token prediction predicts the "
            "tokens after the next of a causal model; BERT's masked LM has no next token"
        )
    if not depth < t.seq_length:
        raise ConfigError(
            f"model.mtp_num_layers = {depth} with training.seq_length = {t.seq_length}: depth k "
            "predicts the token k + 1 places past the next, so a sequence of "
            f"{t.seq_length} tokens has no target at depth {depth}; use fewer depths than "
            "training.seq_length"
        )
    if not m.mtp_loss_scaling_factor >= 0:
        raise ConfigError(
            f"model.mtp_loss_scaling_factor must be >= 0, got {m.mtp_loss_scaling_factor}"
        )
    if t.fused_linear_cross_entropy:
        raise ConfigError(
            "model.mtp_num_layers with training.fused_linear_cross_entropy = true: the fused loss "
            "is the mean over every token, and each depth's loss leaves out the positions whose "
            "shifted token lies past the sequence or in another document; turn the fused loss off"
        )
