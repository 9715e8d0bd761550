"""A module that starts mpiddp when it is imported, as an unguarded training script does: a
DataLoader worker that 'spawn' starts imports it again to unpickle its dataset
(``data_loader_worker.py``)."""
import torch

import mpiddp

mpiddp.init()


class Numbers(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, index):
        return torch.tensor(float(index))
