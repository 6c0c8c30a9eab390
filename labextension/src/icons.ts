/** The extension's icon, in one module (a GPU board; colours from the theme). */
import { LabIcon } from '@jupyterlab/ui-components';

const GPU_SVG = `<svg xmlns="http://www.w3.org/2000/svg" width="16" height="16" viewBox="0 0 24 24">
  <g class="jp-icon3" fill="#616161">
    <path d="M3 6h16a2 2 0 0 1 2 2v8a2 2 0 0 1-2 2h-4v2h-2v-2H9v2H7v-2H3V6zm2 2v8h14V8H5z"/>
    <circle cx="10" cy="12" r="2.5"/>
    <rect x="14" y="10" width="3" height="4"/>
    <rect x="1" y="8" width="2" height="2"/>
  </g>
</svg>`;

export const gpuIcon = new LabIcon({
  name: 'jupyter-gpu-hotplug:gpu',
  svgstr: GPU_SVG
});
