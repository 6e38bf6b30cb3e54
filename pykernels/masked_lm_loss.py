# placeholder: owned by the loss work
def masked_lm_loss(*a, **k): raise NotImplementedError
def shift_labels(*a, **k): raise NotImplementedError
