# placeholder: owned by the loss work
def cross_entropy(*a, **k): raise NotImplementedError
