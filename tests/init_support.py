"""What ``ds_ext.initialize`` says when it refuses a configuration, for the refusal tests of several
modules (run on their ranks)."""


def initialize_error(model, config: dict) -> tuple[str, str] | None:
    """``ds_ext.initialize`` of ``model`` with AdamW under ``config``: (error type name, message) of
    its refusal, or None when it starts."""
    import torch

    import ds_ext

    try:
        ds_ext.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=config)
    except Exception as err:  # noqa: BLE001 - the test inspects the type and message
        return type(err).__name__, str(err)
    return None
