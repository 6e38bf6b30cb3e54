# placeholder: owned by the layer_norm work
def layer_norm(*a, **k): raise NotImplementedError
