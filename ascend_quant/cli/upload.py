"""`ascend-quant upload`: publish a checkpoint to the Hugging Face Hub with its model card."""

from __future__ import annotations

import click


@click.command("upload")
@click.argument("folder", type=click.Path(file_okay=False))
@click.argument("repo_id")
@click.option("--private", is_flag=True, help="Create the repository as private.")
@click.option("--revision", default=None, help="Branch to commit to (created if missing).")
@click.option("--commit-message", default=None)
@click.option("--dry-run", is_flag=True, help="Print the files, sizes and card; touch no network.")
def upload_cmd(folder, repo_id, private, revision, commit_message, dry_run):
    """Upload FOLDER (an Ascend checkpoint) to REPO_ID in one commit, refreshing its model card."""
    from ascend_quant.hub import HubError, plan_upload, upload

    try:
        plan = plan_upload(folder, repo_id)
    except HubError as e:
        raise click.ClickException(str(e)) from None
    from pathlib import Path
    root = Path(folder)
    click.echo(f"{'would upload' if dry_run else 'uploading'} {len(plan.files)} files "
               f"({plan.total_bytes:,} bytes) to {repo_id}{'@' + revision if revision else ''}:")
    for p in plan.files:
        click.echo(f"  {p.relative_to(root)}  {p.stat().st_size:,}")
    for p in plan.skipped:
        click.echo(f"  skipped (not part of the checkpoint): {p.relative_to(root)}")
    if dry_run:
        click.echo("--- model card (README.md) ---")
        click.echo(plan.card)
        return
    try:
        url = upload(plan, folder, private=private, revision=revision, commit_message=commit_message)
    except HubError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"done: {url}")
