"""pytorch/examples `dcgan/main.py`, recorded by `lab`: 2 arms x 2 repeats, checkpoints, resume.

The original trains a DCGAN: a generator `netG` and a discriminator `netD`, each with its own
Adam optimizer, and per batch first the D step (real, then fake), then the G step, with
`BCELoss` and a fixed noise batch for samples. This keeps its `weights_init`, `Generator`,
`Discriminator`, the two steps and its printed line; what changes:

- the sizes: 16x16 one-channel images (the original's layers for 64x64, one fewer on each
  side), from `blobs()`, a small deterministic dataset of Gaussian bumps (the original reads
  LSUN, CIFAR-10 or MNIST through torchvision);
- the loop runs inside `train_run(run)` under a `lab.RunHandle` with both optimizers,
  `optimizer={"g": optimizerG, "d": optimizerD}`: one step is one D step and one G step, and
  Loss_D, Loss_G, D(x) and D(G(z)) go to the store as `loss_D`, `loss_G`, `D_x`, `D_G_z1`,
  `D_G_z2`;
- checkpoints hold both networks, both optimizers, every RNG and the data position, every
  `--save-every` steps; the original's `netG_epoch_N.pth`/`netD_epoch_N.pth` files are
  written into each checkpoint by `loop.on_save` (they commit with it, or not at all), and
  the original's `real_samples.png`/`fake_samples_epoch_N.png` (torchvision) are logged with
  `loop.log_image`: PNGs in the run's folder, with rows in the store's `images` table;
- arms: Adam's `beta1` as in the DCGAN paper (0.5) and Adam's default (0.9), 2 repeats each.

    python examples/dcgan.py                      # into ./lab.db and ./runs
    python examples/dcgan.py --stop-at 25         # SIGKILLed at step 25 of the last run...
    python examples/dcgan.py                      # ...which this resumes; the rest are reused
"""

from __future__ import annotations

import argparse

import pydantic
import torch
import torch.nn as nn
import torch.optim as optim
from torch.utils.data import DataLoader, TensorDataset

from lab import Arm, CheckpointConfig, RunHandle

from _lab import parse_args, run_experiment


class Config(pydantic.BaseModel):
    batchSize: int = 32
    imageSize: int = 16
    nz: int = 16
    ngf: int = 16
    ndf: int = 16
    niter: int = 4
    lr: float = 0.0002
    beta1: float = 0.5
    n_images: int = 512
    save_every: int = 10
    log_interval: int = 8
    no_accel: bool = False


nc = 1  # one channel


# custom weights initialization called on netG and netD
def weights_init(m):
    classname = m.__class__.__name__
    if classname.find("Conv") != -1:
        torch.nn.init.normal_(m.weight, 0.0, 0.02)
    elif classname.find("BatchNorm") != -1:
        torch.nn.init.normal_(m.weight, 1.0, 0.02)
        torch.nn.init.zeros_(m.bias)


class Generator(nn.Module):
    def __init__(self, nz, ngf):
        super().__init__()
        self.main = nn.Sequential(
            # input is Z, going into a convolution
            nn.ConvTranspose2d(nz, ngf * 4, 4, 1, 0, bias=False),
            nn.BatchNorm2d(ngf * 4),
            nn.ReLU(True),
            # state size. (ngf*4) x 4 x 4
            nn.ConvTranspose2d(ngf * 4, ngf * 2, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ngf * 2),
            nn.ReLU(True),
            # state size. (ngf*2) x 8 x 8
            nn.ConvTranspose2d(ngf * 2, nc, 4, 2, 1, bias=False),
            nn.Tanh(),
            # state size. (nc) x 16 x 16
        )

    def forward(self, input):
        return self.main(input)


class Discriminator(nn.Module):
    def __init__(self, ndf):
        super().__init__()
        self.main = nn.Sequential(
            # input is (nc) x 16 x 16
            nn.Conv2d(nc, ndf, 4, 2, 1, bias=False),
            nn.LeakyReLU(0.2, inplace=True),
            # state size. (ndf) x 8 x 8
            nn.Conv2d(ndf, ndf * 2, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ndf * 2),
            nn.LeakyReLU(0.2, inplace=True),
            # state size. (ndf*2) x 4 x 4
            nn.Conv2d(ndf * 2, 1, 4, 1, 0, bias=False),
            nn.Sigmoid(),
        )

    def forward(self, input):
        output = self.main(input)
        return output.view(-1, 1).squeeze(1)


def blobs(n: int, size: int, *, seed: int) -> TensorDataset:
    """`n` images of one Gaussian bump each, at a random place and width, scaled to [-1, 1]
    as the original's `Normalize((0.5,), (0.5,))` scales its images."""
    gen = torch.Generator().manual_seed(seed)
    centre = torch.rand(n, 2, generator=gen) * (size - 4) + 2
    width = torch.rand(n, 1, 1, generator=gen) * 1.5 + 1.0
    grid = torch.arange(size, dtype=torch.float32)
    dy = (grid.view(1, size, 1) - centre[:, 0].view(n, 1, 1)) ** 2
    dx = (grid.view(1, 1, size) - centre[:, 1].view(n, 1, 1)) ** 2
    image = torch.exp(-(dx + dy) / (2 * width**2))
    return TensorDataset(image.unsqueeze(1) * 2 - 1)


def grid(images, nrow=8):
    """torchvision's `make_grid(normalize=True)` in miniature: N images of CxHxW in
    [-1, 1] side by side, `nrow` a row, as one CxH'xW' image in [0, 1]."""
    n, c, h, w = images.shape
    rows = -(-n // nrow)
    out = torch.zeros(c, rows * h, nrow * w)
    for k, image in enumerate(images.cpu()):
        r, col = divmod(k, nrow)
        out[:, r * h : (r + 1) * h, col * w : (col + 1) * w] = image
    return (out + 1) / 2


def train_run(run):
    """One arm x repeat: the original script's body, with its loop on a RunHandle."""
    opt = run.config
    use_accel = not opt.no_accel and torch.accelerator.is_available()
    device = torch.accelerator.current_accelerator() if use_accel else torch.device("cpu")

    dataset = blobs(opt.n_images, opt.imageSize, seed=1)
    dataloader = DataLoader(dataset, batch_size=opt.batchSize, shuffle=True, drop_last=True)

    nz, ngf, ndf = opt.nz, opt.ngf, opt.ndf
    netG = Generator(nz, ngf).to(device)
    netG.apply(weights_init)
    netD = Discriminator(ndf).to(device)
    netD.apply(weights_init)

    criterion = nn.BCELoss()

    fixed_noise = torch.randn(opt.batchSize, nz, 1, 1, device=device)
    real_label = 1
    fake_label = 0

    # setup optimizer
    optimizerD = optim.Adam(netD.parameters(), lr=opt.lr, betas=(opt.beta1, 0.999))
    optimizerG = optim.Adam(netG.parameters(), lr=opt.lr, betas=(opt.beta1, 0.999))

    def save_networks(folder, step):
        """The original's per-epoch files, written into each checkpoint as it is saved."""
        epoch = loop.state.epoch
        torch.save(netG.state_dict(), folder / f"netG_epoch_{epoch}.pth")
        torch.save(netD.state_dict(), folder / f"netD_epoch_{epoch}.pth")

    with RunHandle(
        run,
        nn.ModuleDict({"netG": netG, "netD": netD}),
        {"g": optimizerG, "d": optimizerD},
        num_steps=opt.niter * len(dataloader),
        checkpoint=CheckpointConfig(every=opt.save_every, keep_last=2),
        metrics=["loss_D", "loss_G", "D_x", "D_G_z1", "D_G_z2"],
        device=device,
    ) as loop:
        loop.on_save(save_networks)
        batches = loop.batches(dataloader)  # its epochs and position are saved and restored
        for _ in loop.steps():
            data = loop.pre_step(next(batches)).data
            epoch, i = loop.state.epoch, loop.state.batch_in_epoch - 1
            ############################
            # (1) Update D network: maximize log(D(x)) + log(1 - D(G(z)))
            ###########################
            # train with real
            netD.zero_grad()
            real_cpu = data[0].to(device)
            batch_size = real_cpu.size(0)
            label = torch.full((batch_size,), real_label, dtype=real_cpu.dtype, device=device)

            output = netD(real_cpu)
            errD_real = criterion(output, label)
            errD_real.backward()
            D_x = output.mean().item()

            # train with fake
            noise = torch.randn(batch_size, nz, 1, 1, device=device)
            fake = netG(noise)
            label.fill_(fake_label)
            output = netD(fake.detach())
            errD_fake = criterion(output, label)
            errD_fake.backward()
            D_G_z1 = output.mean().item()
            errD = errD_real + errD_fake
            optimizerD.step()

            ############################
            # (2) Update G network: maximize log(D(G(z)))
            ###########################
            netG.zero_grad()
            label.fill_(real_label)  # fake labels are real for generator cost
            output = netD(fake)
            errG = criterion(output, label)
            errG.backward()
            D_G_z2 = output.mean().item()
            optimizerG.step()

            fake = None
            if i % 100 == 0:  # sampled before the step ends, so a save at it includes this
                fake = netG(fixed_noise).detach()
            loop.end_step(
                {
                    "loss_D": errD.item(),
                    "loss_G": errG.item(),
                    "D_x": D_x,
                    "D_G_z1": D_G_z1,
                    "D_G_z2": D_G_z2,
                }
            )
            if fake is not None:  # the original's PNGs, as images of the ended step
                loop.log_image("real_samples", grid(real_cpu))
                loop.log_image("fake_samples", grid(fake))
            if i % opt.log_interval == 0:
                print(
                    f"[{epoch}/{opt.niter}][{i}/{len(dataloader)}] Loss_D: {errD.item():.4f} "
                    f"Loss_G: {errG.item():.4f} D(x): {D_x:.4f} "
                    f"D(G(z)): {D_G_z1:.4f} / {D_G_z2:.4f}"
                )
    return loop.artifacts


def main():
    defaults = Config()
    parser = argparse.ArgumentParser(description="PyTorch DCGAN example, recorded by lab")
    parser.add_argument(
        "--batchSize",
        type=int,
        default=defaults.batchSize,
        help="input batch size (default: %(default)s)",
    )
    parser.add_argument(
        "--nz",
        type=int,
        default=defaults.nz,
        help="size of the latent z vector (default: %(default)s)",
    )
    parser.add_argument("--ngf", type=int, default=defaults.ngf)
    parser.add_argument("--ndf", type=int, default=defaults.ndf)
    parser.add_argument(
        "--niter",
        type=int,
        default=defaults.niter,
        help="number of epochs to train for (default: %(default)s)",
    )
    parser.add_argument(
        "--lr", type=float, default=defaults.lr, help="learning rate (default: %(default)s)"
    )
    parser.add_argument(
        "--n-images",
        type=int,
        default=defaults.n_images,
        help="images in the dataset (default: %(default)s)",
    )
    parser.add_argument(
        "--save-every",
        type=int,
        default=defaults.save_every,
        metavar="N",
        help="save a checkpoint every N steps (default: %(default)s)",
    )
    parser.add_argument(
        "--log-interval",
        type=int,
        default=defaults.log_interval,
        metavar="N",
        help="print every N batches (default: %(default)s)",
    )
    parser.add_argument("--no-accel", action="store_true", help="disables accelerator")
    parser.add_argument(
        "--manualSeed", type=int, default=0, help="seed of the first repeat (default: %(default)s)"
    )
    args = parse_args(parser)

    config = Config(
        batchSize=args.batchSize,
        nz=args.nz,
        ngf=args.ngf,
        ndf=args.ndf,
        niter=args.niter,
        lr=args.lr,
        n_images=args.n_images,
        save_every=args.save_every,
        log_interval=args.log_interval,
        no_accel=args.no_accel,
    )
    arms = [Arm("beta1-0.5", beta1=0.5), Arm("beta1-0.9", beta1=0.9)]
    result = run_experiment(
        "dcgan", train_run, args, base_config=config, arms=arms, seed=args.manualSeed,
        metric="loss_G", mode="min",  # every door ranks the arms by it
        bounds={"D_x": (0, 1), "D_G_z1": (0, 1), "D_G_z2": (0, 1)},  # D's mean probabilities
    )  # fmt: skip
    print(result.summary())


if __name__ == "__main__":
    main()
