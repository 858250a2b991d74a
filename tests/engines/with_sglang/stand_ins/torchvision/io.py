from _unavailable import stand_in

__getattr__ = stand_in(__name__)
